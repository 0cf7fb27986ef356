"""The `harvest` command: run, plan, status, verify, inspect, report, schedule."""
