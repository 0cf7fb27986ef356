"""Which rows each rank and worker reads, in what order: the shard windows and their
seeded order (order.py, sampling.py), the global permutation (permute.py), and how well
a batch mixes documents (mixing.py: describe())."""
