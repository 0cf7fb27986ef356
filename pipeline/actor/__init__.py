"""The capture actor: one engine, its units' writers, generation slots."""
