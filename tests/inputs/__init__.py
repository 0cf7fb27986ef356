"""Inputs: data sources, packing, chats, generation slots, config values, messages."""
