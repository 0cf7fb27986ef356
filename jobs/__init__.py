"""Entrypoints for `ray job submit` (`python -m harvest.jobs.harvest --config run.yaml`)."""
