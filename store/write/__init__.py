"""Writing: a store created, rows into block buffers, shard objects streamed and uploaded."""
