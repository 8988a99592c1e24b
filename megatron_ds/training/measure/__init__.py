"""Measurements of a live run on this machine: per-stage memory, allocation traces, stage timers
and the per-group timing `--pp-partition-method profile` uses."""
