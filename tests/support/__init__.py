"""Helpers shared by several test modules (not test modules themselves: pytest collects nothing
here, and no test module imports another)."""
