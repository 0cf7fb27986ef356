"""The `harvest` command: main.py parses the arguments and runs one command of commands/ (one
module per command); args.py is what the commands share; views, text, estimate, objectcost and
report build what they print."""
