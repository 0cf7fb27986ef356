"""Errors of the run as a whole (config, data and store errors have their own classes)."""

from __future__ import annotations


class HarvestError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class ResumeMismatch(HarvestError):
    """The store was made by a different config or data: resuming would make a mixed store."""
