"""Django settings for ``bench/soak.py``: both backends at once, the worker picks one with ``--backend``.

- ``database``: django-jobs' database backend on the default database, PostgreSQL
  ``SOAK_PG_NAME`` (default ``bench_soak``, created and dropped by soak.py).
- ``redis``: the Redis backend on ``SOAK_REDIS_URL`` (default ``redis://127.0.0.1:6379/13``, a
  logical database of its own, flushed by soak.py before and after) with key prefix ``soak``.
  Its jobs touch PostgreSQL only for failure audit rows, which a no-op run never writes.

``SOAK_PG_HOST`` / ``SOAK_PG_PORT`` / ``SOAK_PG_USER`` choose the server (default
127.0.0.1:5432, user ``postgres``, no password). Everything else is django-jobs' defaults:
signatures verified, 60 s leases, ``POLL_INTERVAL`` 1 s, ``PREFETCH`` 100, DEBUG off (DEBUG on
would keep every query in memory and make the RSS grow by itself).
"""

import os

PG_NAME = os.environ.get("SOAK_PG_NAME", "bench_soak")
PG_HOST = os.environ.get("SOAK_PG_HOST", "127.0.0.1")
PG_PORT = os.environ.get("SOAK_PG_PORT", "5432")
PG_USER = os.environ.get("SOAK_PG_USER", "postgres")
SOAK_REDIS_URL = os.environ.get("SOAK_REDIS_URL", "redis://127.0.0.1:6379/13")
SOAK_REDIS_PREFIX = "soak"  # every key soak.py and its jobs write starts with this
SOAK_LATENCY_KEY = f"{SOAK_REDIS_PREFIX}:latency"  # list the latency jobs push their pick-up delay to

SECRET_KEY = "bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_jobs"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": PG_NAME,
        "HOST": PG_HOST,
        "PORT": PG_PORT,
        "USER": PG_USER,
        "CONN_MAX_AGE": None,
    }
}

JOBS = {
    "BACKENDS": {
        "database": {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}},
        "redis": {"ENGINE": "redis", "OPTIONS": {"URL": SOAK_REDIS_URL, "PREFIX": SOAK_REDIS_PREFIX}},
    },
    "DEFAULT_BACKEND": "database",
    "QUEUES": ["default"],
    "IMPORTS": ["bench.soak_jobs"],
}
