"""Loaded by every Python process started with this directory on PYTHONPATH: with CALL_TIMING set,
wraps the device update's parts (call_timing.py) in each, the benchmark's worker processes too."""
import os

if os.environ.get("CALL_TIMING"):
    import call_timing  # noqa: F401
