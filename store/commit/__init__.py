"""Commits: the markers that make rows data, object tables, publishing, the plan log, finalize and verify."""
