"""Side-by-side speed measurements (`python -m harvest.benchmarks.run_all`)."""
