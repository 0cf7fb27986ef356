"""Streaming captured rows straight into trainers, with no store in between (docs/store.md,
"Streaming to trainers"): `harvest.stream(config, points=..., batch_size=..., rank=...,
world_size=...)` (api.py) is a dataset like the store's reader whose rows come from the capture
actors. The run itself is the driver's (`driver.run` with this package's hooks, hooks.py) hosted
by one coordinator actor per stream (coordinator.py); each trainer rank takes its rows from every
capture actor (receiver.py) into shuffle windows (windows.py).

Layer: above the driver (it runs one), below the CLI (which prices it: `harvest plan`).
"""
