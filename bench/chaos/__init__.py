"""The chaos battery's helpers (bench/chaos.py is the entry point)."""
