"""Entrypoints for `ray job submit` (`python -m jobs.harvest --config run.yaml`)."""
