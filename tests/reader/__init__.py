"""The SAE-training reader: batches, filters, mixing, splits, workers, trainer adapters, parity."""
