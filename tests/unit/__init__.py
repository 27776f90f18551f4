"""Unit tests: no server needed (SQLite, in-memory fakes, threads of this process only)."""
