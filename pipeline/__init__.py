"""harvest pipeline: dataset -> packed contexts -> shard-aligned work units -> Ray engine actors -> store.

Kept import-light on purpose: `import harvest.store` in an SAE training job must not pull Ray,
datasets or the engine.
"""
