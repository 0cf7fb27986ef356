"""The store: create, write, commit, verify, storage backends, integrity."""
