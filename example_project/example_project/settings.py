"""Settings for the django-jobs example project.

A demo, not a template for production: the secret key is public and DEBUG is on.
Run everything from the example_project/ folder (``python manage.py ...``) with
django-jobs installed (``scripts/demo`` installs it editable into ``.venv``).
"""

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "django-insecure-example-project-only-never-use-this-key"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_jobs",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# One SQLite file shared by the web process and any number of worker processes.
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
        "OPTIONS": {
            # Wait up to 20 s for another process's write lock instead of failing
            # at once with "database is locked".
            "timeout": 20,
            # Take the write lock when a transaction starts (BEGIN IMMEDIATE), so two
            # processes never deadlock upgrading a read lock to a write lock.
            "transaction_mode": "IMMEDIATE",
            # WAL lets readers (the admin) work while a worker writes.
            "init_command": "PRAGMA journal_mode=WAL;",
        },
    }
}

# Idempotency keys are remembered in a Django cache (JOBS["IDEMPOTENCY_CACHE"],
# "default"). It must be shared by every process that dispatches or runs jobs: the
# default LocMemCache lives inside one process, so two workers would each think a
# key is new. The database cache lives in the same SQLite file and is shared.
# Create its table with `python manage.py createcachetable`.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "django_cache",
    }
}

JOBS = {
    # Known queues; the first is the default. Dispatching to any other name is an error.
    # shop.jobs.send_receipt goes to "emails", the other demo jobs to "default".
    "QUEUES": ["default", "emails"],
    # Wait longer before each retry: base * 2 ** (attempt - 2), with ±15 % jitter.
    "RETRY_BACKOFF_STRATEGY": "exponential",
    # Seconds before the first retry (kept tiny so the demo finishes in seconds):
    # retry 1 after ~1 s, retry 2 after ~2 s, retry 3 after ~4 s...
    "RETRY_BACKOFF_BASE": 1,
    # Cap in seconds on any retry delay, jitter included.
    "RETRY_BACKOFF_MAX": 10,
    # Everything else keeps its default; notably BACKENDS uses the database backend on
    # the "default" connection, so `migrate` is the whole set-up.
}

AUTH_PASSWORD_VALIDATORS = []  # demo: the admin user is admin/admin

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Show the demo jobs' log lines (and django-jobs warnings, e.g. a job that failed
# for good) in the worker's terminal.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "demo": {
            "format": "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
            "datefmt": "%H:%M:%S",
        },
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "demo"},
    },
    "loggers": {
        "shop": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django_jobs": {"handlers": ["console"], "level": "WARNING", "propagate": False},
    },
}
