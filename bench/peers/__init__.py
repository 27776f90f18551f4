"""Helpers of ``bench/redis_peers.py``: one module per system under test.

Imported as ``peers.*`` with ``bench/`` on ``sys.path`` (the harness sets ``PYTHONPATH``).
"""
