"""The driver: preparation, Ray cluster and actors, dispatch, planning, health, resume, the store sink, exits."""
