"""How decoded rows reach the trainer: shards fetched and decoded ahead (readahead.py),
cut into batches (batching.py), and handed from DataLoader workers (loader.py,
handoff.py: shared-memory slots; workermem.py: worker memory)."""
