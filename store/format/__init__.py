"""The store's format: names and sizes, element types, codecs, row roles, what a store is (StoreSpec)."""
