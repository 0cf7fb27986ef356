"""harvest's activation store and its SAE-training reader, installed alone (package harvest-store).

This light install carries `harvest.pipeline.store` only: no engine, Ray or vLLM. Do not install
it beside the full `harvest` package, which provides the same `harvest.pipeline` package.
"""
