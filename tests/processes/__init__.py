"""Process-level tests: modules that start ``manage.py`` (``jobs_work``, ``jobs_reap``, ...)
subprocesses through tests/procs.py, besides in-process tests of the same subject; and the
backend batteries that run once, on the main entry of scripts/test (test_fanout.py)."""
