"""Runs under faults: killed actors and drivers, deadlines, leases, memory, publishing after crashes, the Ray reaper."""
