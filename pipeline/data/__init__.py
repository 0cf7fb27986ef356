"""Documents to token contexts: sources and blocks, chats, packing, tokenising workers, a unit's rows."""
