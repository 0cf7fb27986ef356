"""Checks run on a lent GPU host (torch only there: no vLLM, Ray or zarr install)."""
