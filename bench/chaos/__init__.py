"""The chaos battery's helpers (bench/chaos_battery.py is the entry point)."""
