"""Django settings for the django-jobs side of ``bench/redis_peers.py``: the Redis backend.

The Redis backend named ``redis`` (the default backend here) uses ``BENCH_REDIS_DB`` (12) on
127.0.0.1:6379 with its own key prefix; the SQLite default database (``BENCH_SQLITE_PATH``)
only holds the audit rows of permanent failures, which a no-op run never writes. Everything
else is django-jobs' defaults: signatures verified, 60 s leases, in-memory metrics.
"""

import os

from peers.common import REDIS_URL

SECRET_KEY = "bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_jobs"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("BENCH_SQLITE_PATH", "bench-redis.sqlite3"),
    }
}

JOBS = {
    "DEFAULT_BACKEND": "redis",
    "BACKENDS": {"redis": {"ENGINE": "redis", "OPTIONS": {"URL": REDIS_URL, "PREFIX": "bench_jobs"}}},
    "QUEUES": ["default"],
    "IMPORTS": ["peers.djjobs_tasks"],
}
