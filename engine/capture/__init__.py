"""Torch-only capture parts: taps, block semantics and the probe, row transport and accounting, shared-memory rings."""
