"""Statistics: running per-point moments, per unit and merged in the store."""
