"""Whole runs: the driver and actors end to end, TP, generation, chats, token-id inputs, the console."""
