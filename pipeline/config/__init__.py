"""The run configuration: sections, field checks, YAML reading and paths (the lowest layer of the pipeline)."""
