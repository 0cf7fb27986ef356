"""Test and benchmark helpers: a throwaway SeaweedFS S3 server (seaweed.py) and synthetic
activations written into stores (synthetic.py).

Kept out of `harvest.store` so the light harvest-store package (what an SAE trainer's
environment installs) ships no test server and no data generator: it packages the store folder
whole. The full package installs this as `harvest.testing` (tests, benchmarks and CI use it).
"""
