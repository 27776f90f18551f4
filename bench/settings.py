"""Minimal Django settings for the django-jobs vs django-tasks-db benchmark.

Everything is chosen by environment variables, so the harness (bench/run.py)
can point each subprocess at a fresh database:

BENCH_SYSTEM       ``jobs`` (django-jobs) or ``tasksdb`` (django-tasks-db).
                   Only the measured system's app is installed, so neither pays
                   for the other's signal handlers or migrations.
BENCH_DB           ``sqlite`` (default) or ``postgres``.
BENCH_SQLITE_PATH  path of the SQLite file (required for sqlite).
BENCH_PG_NAME      PostgreSQL database name (default ``bench_jobs``).
BENCH_PG_HOST / BENCH_PG_PORT / BENCH_PG_USER / BENCH_PG_PASSWORD
                   connection (default 127.0.0.1:5432, user postgres, no password).
BENCH_CONN_MAX_AGE Django's CONN_MAX_AGE: ``0`` (Django's default: a worker that
                   calls close_old_connections() reconnects after every job) or
                   ``none`` (persistent connections). Default ``0``.
BENCH_REDIS_URL    a django-jobs backend ``redis`` on that Redis (bench/topology.py).
BENCH_REDIS_CLUSTER_URL  a backend ``redis_cluster`` on the Redis Cluster of that node.
BENCH_REDIS_PREFIX their key prefix (default ``benchtopo``).
BENCH_QUEUES       the queues, comma-separated (default ``default``).

Both systems run with their defaults otherwise (no tuning): DEBUG off, the stock
SQLite journal and transaction modes.
"""

import os

SYSTEM = os.environ.get("BENCH_SYSTEM", "jobs")
if SYSTEM not in {"jobs", "tasksdb"}:
    raise RuntimeError(f"BENCH_SYSTEM must be 'jobs' or 'tasksdb', not {SYSTEM!r}")

SECRET_KEY = "bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz"
DEBUG = False  # DEBUG=True would record every query and turn on db_worker --reload
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = ["django_jobs"] if SYSTEM == "jobs" else ["django_tasks_db"]

_conn_max_age = os.environ.get("BENCH_CONN_MAX_AGE", "0").strip().lower()
CONN_MAX_AGE = None if _conn_max_age in {"none", "persistent"} else int(_conn_max_age)

if os.environ.get("BENCH_DB", "sqlite") == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("BENCH_PG_NAME", "bench_jobs"),
            "HOST": os.environ.get("BENCH_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("BENCH_PG_PORT", "5432"),
            "USER": os.environ.get("BENCH_PG_USER", "postgres"),
            "PASSWORD": os.environ.get("BENCH_PG_PASSWORD", ""),
            "CONN_MAX_AGE": CONN_MAX_AGE,
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("BENCH_SQLITE_PATH", "bench.sqlite3"),
            "CONN_MAX_AGE": CONN_MAX_AGE,
        }
    }

# django-jobs: the database backend on the default connection; the worker
# imports the module holding the no-op @job (bench/ is on PYTHONPATH).
JOBS = {
    "BACKENDS": {"default": {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}}},
    "QUEUES": ["default"],
    "IMPORTS": ["benchjobs"],
}
JOBS["QUEUES"] = os.environ.get("BENCH_QUEUES", "default").split(",")
_redis = {"PREFIX": os.environ.get("BENCH_REDIS_PREFIX", "benchtopo")}
if os.environ.get("BENCH_REDIS_URL"):
    JOBS["BACKENDS"]["redis"] = {"ENGINE": "redis", "OPTIONS": {**_redis, "URL": os.environ["BENCH_REDIS_URL"]}}
if os.environ.get("BENCH_REDIS_CLUSTER_URL"):
    _cluster = {**_redis, "CLUSTER": True, "URL": os.environ["BENCH_REDIS_CLUSTER_URL"]}
    JOBS["BACKENDS"]["redis_cluster"] = {"ENGINE": "redis", "OPTIONS": _cluster}

# django-tasks-db: the ORM backend, as its README configures it.
if SYSTEM == "tasksdb":
    TASKS = {
        "default": {
            "BACKEND": "django_tasks_db.DatabaseBackend",
            "QUEUES": ["default"],
        }
    }
