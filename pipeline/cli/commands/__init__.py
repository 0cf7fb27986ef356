"""The `harvest` commands, one module each (`<name>.py`, `check-model` as check_model.py): each
defines `add_parser(sub)`, which adds its subcommand and sets `fn` to its `cmd_<name>(args)`;
pipeline/cli/main.py lists them and runs the one asked for."""
