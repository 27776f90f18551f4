"""Django settings for the chaos battery (bench/chaos_battery.py). Everything comes from CHAOS_* variables,
which the driver sets for itself and passes to every ``jobs_work`` subprocess:

CHAOS_BACKEND        postgres | redis | beanstalk: the engine of the one JOBS backend, ``chaos``
CHAOS_PG_NAME        the dedicated PostgreSQL database (created and dropped by the driver)
CHAOS_PG_HOST/PORT/USER/PASSWORD   its server (default 127.0.0.1:5432, user postgres)
CHAOS_REDIS_URL      the PRIVATE redis-server the driver started (redis backend), or the
                     redis+sentinel:// URL of its PRIVATE Sentinel group (sentinel backend)
CHAOS_REDIS_CLUSTER_NODES  host:port,... of the PRIVATE Redis Cluster's nodes (redis backend, instead)
CHAOS_BEANSTALK      host:port of the PRIVATE beanstalkd the driver started (beanstalk backend)
CHAOS_PREFIX         key / tube prefix
CHAOS_LEASE_TIMEOUT  LEASE_TIMEOUT in seconds (small, so stalls and crashes are recovered fast)

The side-effect tables (chaos_run, chaos_effect) always live in the PostgreSQL database, whatever
the backend, so every run of every job is counted in one place.
"""

import os

BACKEND = os.environ.get("CHAOS_BACKEND", "postgres")

SECRET_KEY = "chaos-battery-only-not-a-secret-0123456789abcdefghijklmnop"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_jobs"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("CHAOS_PG_NAME", "chaos_jobs"),
        "HOST": os.environ.get("CHAOS_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("CHAOS_PG_PORT", "5432"),
        "USER": os.environ.get("CHAOS_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("CHAOS_PG_PASSWORD", ""),
        # Django's default: a connection lasts one "request"; workers reconnect after errors.
        "CONN_MAX_AGE": 0,
        # A restarted server must not leave a worker blocked on a half-open socket for minutes.
        "OPTIONS": {"connect_timeout": 5},
    }
}

PREFIX = os.environ.get("CHAOS_PREFIX", "chaos")
if BACKEND == "postgres":
    ENGINE = {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}}
elif BACKEND == "redis":  # CHAOS_REDIS_URL may be a redis+sentinel:// URL
    ENGINE = {
        "ENGINE": "redis",
        "OPTIONS": {"URL": os.environ.get("CHAOS_REDIS_URL", "redis://127.0.0.1:6379/0"), "PREFIX": PREFIX},
    }
    if os.environ.get("CHAOS_REDIS_CLUSTER_NODES"):
        _nodes = [node.rpartition(":") for node in os.environ["CHAOS_REDIS_CLUSTER_NODES"].split(",")]
        # Every node a startup node: a worker reconnecting after a primary's crash finds one alive.
        ENGINE["OPTIONS"] = {"CLUSTER": True, "STARTUP_NODES": [(h, int(p)) for h, _, p in _nodes], "PREFIX": PREFIX}
elif BACKEND == "beanstalk":
    _host, _, _port = os.environ.get("CHAOS_BEANSTALK", "127.0.0.1:11300").partition(":")
    ENGINE = {"ENGINE": "beanstalk", "OPTIONS": {"HOST": _host, "PORT": int(_port), "PREFIX": PREFIX}}
else:
    raise RuntimeError(f"CHAOS_BACKEND must be postgres, redis or beanstalk, not {BACKEND!r}")

JOBS = {
    "DEFAULT_BACKEND": "chaos",
    "BACKENDS": {"chaos": ENGINE},
    # "other" exists so the tamper flood can replay a message signed for "default" onto it.
    "QUEUES": ["default", "other"],
    "HANDLERS": {"chaos": "bench.chaos.jobs.ChaosHandler"},
    "POLL_INTERVAL": 0.05,
    "LEASE_TIMEOUT": float(os.environ.get("CHAOS_LEASE_TIMEOUT", "2")),
    "RETRY_BACKOFF_STRATEGY": "none",
    # Small, so the tamper flood's oversize messages are cheap to write (the cap is what is tested).
    "MAX_MESSAGE_BYTES": 16 * 1024,
}

CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"t": {"format": "%(created).3f %(process)d %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "t"}},
    # WARNING: reaped leases, lease lost, backend errors, supervisor restarts, hard timeouts.
    "loggers": {"django_jobs": {"handlers": ["console"], "level": "WARNING"}},
}
