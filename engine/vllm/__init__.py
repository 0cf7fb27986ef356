"""Everything that touches vLLM: the backend, its runner and row map, the in-worker probe, generation, and the internals it relies on."""
