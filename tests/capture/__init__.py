"""Torch-level capture parts: the points table and addresses, the block probe, shared-memory destinations, parallel layouts."""
