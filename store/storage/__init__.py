"""Where a store's bytes live: the storage interface, local directories, object stores, URLs, secrets, retries."""
