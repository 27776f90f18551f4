"""Settings for the test suite: SQLite as ``default`` and real PostgreSQL as ``postgres``.

Worker subprocesses started by tests use the same module with ``JOBS_TEST_SUBPROCESS=1``,
which points them at the test databases pytest-django created.
"""

import json
import os
from pathlib import Path

import django

BASE = Path(__file__).resolve().parent
SUBPROCESS = os.environ.get("JOBS_TEST_SUBPROCESS") == "1"
# Test database names per test session (worker subprocesses inherit them through the
# environment), so concurrent sessions on one machine never drop each other's databases.
SQLITE_TEST = os.environ.setdefault("JOBS_TEST_SQLITE", str(BASE.parent / f".test-default-{os.getpid()}.sqlite3"))
PG_TEST = os.environ.setdefault("JOBS_TEST_PG_TEST_NAME", f"test_django_jobs_{os.getpid()}")
MARIA_TEST = os.environ.get("JOBS_TEST_MARIA_TEST_NAME", PG_TEST)

SECRET_KEY = "tests-only-secret-key-not-for-production"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The admin's CSS and JS, which the browser tests' live server serves.
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_jobs",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": SQLITE_TEST if SUBPROCESS else str(BASE.parent / ".unused-default.sqlite3"),
        "TEST": {"NAME": SQLITE_TEST},
        # Worker subprocesses take the write lock at BEGIN, as docs/operations.md tells users to
        # for SQLite: a transaction that read first and writes second gets "database is locked"
        # at once (no wait) when another connection writes meanwhile, and loses that write.
        "OPTIONS": {"timeout": 30, **({"transaction_mode": "IMMEDIATE"} if SUBPROCESS else {})},
    },
    "postgres": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": PG_TEST if SUBPROCESS else os.environ.get("JOBS_TEST_PG_NAME", "test"),
        "USER": os.environ.get("JOBS_TEST_PG_USER", "postgres"),
        "HOST": os.environ.get("JOBS_TEST_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("JOBS_TEST_PG_PORT", "5432"),
        "TEST": {"NAME": PG_TEST},
    },
    # MariaDB/MySQL: the claim runs SELECT ... FOR UPDATE SKIP LOCKED inside a transaction.
    "mariadb": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": MARIA_TEST if SUBPROCESS else os.environ.get("JOBS_TEST_MARIA_NAME", "test"),
        "USER": os.environ.get("JOBS_TEST_MARIA_USER", "root"),
        "PASSWORD": os.environ.get("JOBS_TEST_MARIA_PASSWORD", ""),
        "HOST": os.environ.get("JOBS_TEST_MARIA_HOST", "127.0.0.1"),
        "PORT": os.environ.get("JOBS_TEST_MARIA_PORT", "3306"),
        "TEST": {"NAME": MARIA_TEST, "CHARSET": "utf8mb4", "COLLATION": "utf8mb4_bin"},
        "OPTIONS": {"charset": "utf8mb4"},
    },
}

# The same PostgreSQL database through psycopg's server-side binding: a statement's parameters
# travel apart from its text, at most 65,535 of them (the large fan-out tests), and a statement
# run five times is prepared (docs/performance.md, Tuning: dispatch without a pooler).
DATABASES["postgres_ssb"] = {
    **DATABASES["postgres"],
    "OPTIONS": {"server_side_binding": True, "prepare_threshold": 5},
    "TEST": {"MIRROR": "postgres"},
}

# The same PostgreSQL database through PgBouncer in transaction pooling mode (scripts/services
# starts it): no session state survives a transaction. Its test database is the postgres one,
# created and dropped directly (never through the pooler, which holds server connections to it).
PGBOUNCER_PORT = os.environ.get("JOBS_TEST_PGBOUNCER_PORT", "6432")
DATABASES["pgbouncer"] = {
    **DATABASES["postgres"],
    "PORT": PGBOUNCER_PORT,
    "TEST": {"MIRROR": "postgres"},
}

# The same PostgreSQL database through Django's connection pool (``OPTIONS["pool"]``, psycopg_pool;
# Django 5.1 and later): each thread's connection is taken from a pool of its process and handed
# back to it on close (so CONN_MAX_AGE must be 0).
DATABASES["postgres_pool"] = {
    **DATABASES["postgres"],
    "CONN_MAX_AGE": 0,
    "OPTIONS": {"pool": {"min_size": 1, "max_size": 4}},
    "TEST": {"MIRROR": "postgres"},
}

if SUBPROCESS:
    # Worker subprocesses never use MariaDB (only the in-process conformance param does), and
    # their start-up system checks would otherwise connect to its test database.
    del DATABASES["mariadb"]

# MariaDB ignores the partial (conditional) indexes; its claim still uses the full index.
SILENCED_SYSTEM_CHECKS = ["models.W037"]

CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Redis: a dedicated DB number, and a key prefix per test session that worker subprocesses
# inherit through the environment, so concurrent runs never see each other's keys.
REDIS_URL = os.environ.get("JOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
REDIS_PREFIX = os.environ.setdefault("JOBS_TEST_REDIS_PREFIX", f"djt{os.getpid()}")
# A Redis Cluster (scripts/services.d/redis-cluster.sh starts 3 primaries on 7000-7002): the
# backend "redis_cluster" is added where a test uses it (override_settings), and to a worker
# subprocess's settings by JOBS_TEST_REDIS_CLUSTER=1, so commands that visit every backend do
# not reach it otherwise.
_cluster_port = os.environ.get("JOBS_TEST_REDIS_CLUSTER_PORT", "7000")  # as scripts/services reads it
REDIS_CLUSTER_URL = os.environ.get("JOBS_TEST_REDIS_CLUSTER_URL", f"redis://127.0.0.1:{_cluster_port}/0")
REDIS_CLUSTER = {"ENGINE": "redis", "OPTIONS": {"CLUSTER": True, "URL": REDIS_CLUSTER_URL, "PREFIX": REDIS_PREFIX}}
# beanstalkd (scripts/services starts it; the beanstalk_up fixture too): tubes named per session.
BEANSTALK_HOST, _, BEANSTALK_PORT = os.environ.get("JOBS_TEST_BEANSTALK", "127.0.0.1:11300").partition(":")
BEANSTALK_PREFIX = os.environ.setdefault("JOBS_TEST_BEANSTALK_PREFIX", f"djt{os.getpid()}")

JOBS = {
    "BACKENDS": {
        "default": {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}},
        "pg": {"ENGINE": "database", "OPTIONS": {"DATABASE": "postgres"}},
        "sync": {"ENGINE": "sync"},
        "redis": {"ENGINE": "redis", "OPTIONS": {"URL": REDIS_URL, "PREFIX": REDIS_PREFIX}},
        "beanstalk": {
            "ENGINE": "beanstalk",
            "OPTIONS": {"HOST": BEANSTALK_HOST, "PORT": int(BEANSTALK_PORT), "PREFIX": BEANSTALK_PREFIX},
        },
        # Azure Service Bus: tests swap the SDK's clients for an in-memory namespace
        # (tests/fake_servicebus.py); this connection string is never dialled.
        "servicebus": {
            "ENGINE": "servicebus",
            "OPTIONS": {
                "CONNECTION_STRING": "Endpoint=sb://django-jobs-tests.invalid/;SharedAccessKeyName=tests;SharedAccessKey=dGVzdHM=",
                "RECEIVE_WAIT": 0.05,
            },
        },
    },
    "QUEUES": ["default", "other", "emails"],
    "POLL_INTERVAL": 0.05,
    # The command handler runs only allowlisted management commands (tests/integration/test_api.py runs it).
    "ALLOWED_COMMANDS": ["clearsessions"],
    # Modules of @job functions the tests dispatch, outside tests/testapp/jobs.py.
    "IMPORTS": ["tests.api_support"],
    # A function handler that takes its context (tests of aborting a running job).
    "HANDLERS": {"abortable": "tests.testapp.jobs.abortable"},
}
# Redis through Sentinel (scripts/services.d/redis-sentinel.sh starts the group). Kept out of
# BACKENDS, where commands that visit every backend would reach it, except in the processes of a
# test that points them at it (JOBS_TEST_SENTINEL=1: the sentinel_backend fixture of conftest.py).
SENTINEL_URL = os.environ.get(
    "JOBS_TEST_SENTINEL_URL", "redis+sentinel://127.0.0.1:26390,127.0.0.1:26391,127.0.0.1:26392/mymaster/9"
)
SENTINEL_BACKEND = {"ENGINE": "redis", "OPTIONS": {"URL": SENTINEL_URL, "PREFIX": REDIS_PREFIX}}
if os.environ.get("JOBS_TEST_SENTINEL"):
    JOBS["BACKENDS"]["redis_sentinel"] = SENTINEL_BACKEND
# django.tasks on django-jobs: one TASKS alias per JOBS backend the task tests run on
# (tests/testapp/tasks.py defines the tasks; worker subprocesses find them by autodiscovery).
TASKS = {
    alias: {"BACKEND": "django_jobs.tasks.JobsTaskBackend", "QUEUES": [], "OPTIONS": {"backend": alias}}
    for alias in ("default", "pg", "redis")
}
if os.environ.get("JOBS_TEST_REDIS_CLUSTER"):
    JOBS["BACKENDS"]["redis_cluster"] = REDIS_CLUSTER
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")  # Django 5.2: the backport of django.tasks

# The database backend through PgBouncer (the ``pgbouncer`` alias): kept out of the shared
# backends, so commands that visit every backend never reach the pooler. A test adds it
# (tests/backend_params.py PG_POOLED), and the worker subprocesses it starts with
# JOBS_TEST_PGBOUNCER=1.
PGBOUNCER_BACKEND = {"ENGINE": "database", "OPTIONS": {"DATABASE": "pgbouncer"}}
if os.environ.get("JOBS_TEST_PGBOUNCER") == "1":
    JOBS["BACKENDS"]["pgbouncer"] = PGBOUNCER_BACKEND
# The database backend through Django's connection pool (the ``postgres_pool`` alias), kept out
# of the shared settings in the same way: added by the pg_pool_backend fixture, and to a worker
# subprocess's settings by JOBS_TEST_PG_POOL=1.
PG_POOL_BACKEND = {"ENGINE": "database", "OPTIONS": {"DATABASE": "postgres_pool"}}
if os.environ.get("JOBS_TEST_PG_POOL") == "1":
    JOBS["BACKENDS"]["pg_pool"] = PG_POOL_BACKEND

if os.environ.get("JOBS_TEST_IDEMPOTENCY_REDIS"):
    # Fault tests: idempotency keys in a Redis of the test's own, which it can freeze.
    CACHES["idem"] = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": os.environ["JOBS_TEST_IDEMPOTENCY_REDIS"],
        "OPTIONS": {"socket_timeout": 60},
    }  # a freeze, not a failure
    JOBS["IDEMPOTENCY_CACHE"] = "idem"
if os.environ.get("JOBS_TEST_LEASE_TIMEOUT"):
    JOBS["LEASE_TIMEOUT"] = float(os.environ["JOBS_TEST_LEASE_TIMEOUT"])
if os.environ.get("JOBS_TEST_ABORT_GRACE"):
    JOBS["ABORT_GRACE"] = float(os.environ["JOBS_TEST_ABORT_GRACE"])
if os.environ.get("JOBS_TEST_QUEUES"):  # JSON: more JOBS["QUEUES"] of the workers a process test starts
    JOBS["QUEUES"] = [*JOBS["QUEUES"], *json.loads(os.environ["JOBS_TEST_QUEUES"])]
if os.environ.get("JOBS_TEST_LIMITS"):  # JSON: JOBS["LIMITS"] of the workers a process test starts
    JOBS["LIMITS"] = json.loads(os.environ["JOBS_TEST_LIMITS"])

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_jobs": {"handlers": ["console"], "level": "WARNING"}},
}

# Fast hashing: the admin tests log users in; the default PBKDF2 costs seconds per login.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
