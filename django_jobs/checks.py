"""System checks: ``manage.py check`` reports bad JOBS settings before a worker starts.

Every key of ``JOBS`` is validated by the rule of :data:`RULES` (its type and range), then the
settings are checked against each other (backends, queues, handlers, caches). A key whose type is
wrong is reported once and left out of the later checks, which would only repeat the problem.
Each check carries the tag :data:`TAG` as well: ``jobs_work`` runs these checks, and no others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from difflib import get_close_matches
from importlib import import_module
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import module_has_submodule

from . import conf, signing
from .exceptions import summary
from .retry import MAX_DELAY_SECONDS, STRATEGIES

# A rule returns why a value is wrong ("must be ..., not ...") or None when it is fine.
Rule = Callable[[Any], "str | None"]

BACKEND_KEYS = ("ENGINE", "OPTIONS")
# The tag of django-jobs' own checks (``manage.py check --tag django_jobs``); the only ones
# ``jobs_work`` runs before it starts.
TAG = "django_jobs"


def _error(msg: str, id: str, hint: str | None = None, obj: Any = "settings.JOBS") -> checks.CheckMessage:
    return checks.Error(msg, hint=hint, obj=obj, id=f"django_jobs.{id}")


def did_you_mean(word: Any, choices: Iterable[str]) -> str | None:
    """``"did you mean 'X'?"`` for the closest of ``choices`` (case-insensitive), or ``None``."""
    if not isinstance(word, str):
        return None
    by_folded = {choice.casefold(): choice for choice in choices}
    match = get_close_matches(word.casefold(), list(by_folded), n=1)
    return f"did you mean {by_folded[match[0]]!r}?" if match else None


# -- rules: one per kind of value ---------------------------------------------------------------------


def _number(*, integer: bool = False, positive: bool = False, optional: bool = False, seconds: bool = False) -> Rule:
    """``seconds``: a duration, at most a year (a date past the year 9999 cannot be stored)."""
    kind = "integer" if integer else "number"
    wanted = f"a {'positive' if positive else 'non-negative'} {kind}"
    if seconds:
        wanted += f" of seconds, at most {MAX_DELAY_SECONDS} (a year)"
    if optional:
        wanted = f"None or {wanted}"
    maximum = MAX_DELAY_SECONDS if seconds else math.inf

    def rule(value: Any) -> str | None:
        if optional and value is None:
            return None
        types = int if integer else (int, float)
        ok = (
            isinstance(value, types)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > 0 if positive else value >= 0)
            and value <= maximum
        )
        return None if ok else f"must be {wanted}, not {conf.describe(value)}"

    return rule


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be True or False, not {conf.describe(value)}"


def _name(value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"must be a non-empty string, not {conf.describe(value)}"


def _optional_name(value: Any) -> str | None:
    return None if value is None else _name(value)


def _names(*, ordered: bool = False, longest: int | None = None) -> Rule:
    return lambda value: conf.names_problem(value, ordered=ordered, longest=longest)


def _dict(value: Any) -> str | None:
    return None if isinstance(value, dict) else f"must be a dict, not {conf.describe(value)}"


def _mapping(value: Any, shape: str, entry: Callable[[Any, Any], str | None]) -> str | None:
    """``value`` must be a dict (of ``shape``) whose every key and value pass ``entry``."""
    if not isinstance(value, dict):
        return f"must be a dict of {shape}, not {conf.describe(value)}"
    return next((problem for key, item in value.items() if (problem := entry(key, item))), None)


def _backend_entry(name: Any, config: Any) -> str | None:
    if not isinstance(config, dict):
        return f"[{name!r}] must be a dict with 'ENGINE' and 'OPTIONS', not {conf.describe(config)}"
    if "ENGINE" in config and _name(config["ENGINE"]):
        return f"[{name!r}]['ENGINE'] {_name(config['ENGINE'])}"
    if config.get("OPTIONS") is not None and not isinstance(config["OPTIONS"], dict):
        return f"[{name!r}]['OPTIONS'] must be a dict, not {conf.describe(config['OPTIONS'])}"
    return None


def _backends(value: Any) -> str | None:
    return _mapping(value, "backend name -> {'ENGINE': ..., 'OPTIONS': {...}}", _backend_entry)


def _handlers(value: Any) -> str | None:
    def entry(key: Any, path: Any) -> str | None:
        if _name(key) or _optional_name(path):
            return f"[{key!r}] must map a non-empty key to a dotted path or None, not {conf.describe(path)}"
        return None

    return _mapping(value, "handler key -> dotted path (or None)", entry)


def _queue_handlers(value: Any) -> str | None:
    def entry(queue: Any, keys: Any) -> str | None:
        problem = conf.names_problem(keys)
        return f"[{queue!r}] {problem}" if problem else None

    return _mapping(value, "queue -> list of handler keys", entry)


def _signing_key(value: Any) -> str | None:
    return None if value is None else signing.key_problem(value)


# Key -> (check id, rule). Every key of conf.DEFAULTS has one: a new setting needs its rule here.
# E004: numbers. E011: settings that guard what may run (signing keys, allowlists): a wrong type
# there weakens security. E010: every other wrong type.
RULES: dict[str, tuple[str, Rule]] = {
    "DEFAULT_BACKEND": ("E010", _name),
    "BACKENDS": ("E010", _backends),
    "QUEUES": ("E010", _names(ordered=True, longest=conf.QUEUE_NAME_LENGTH)),
    "RETRY_BACKOFF_STRATEGY": ("E003", _name),  # then one of STRATEGIES: _strategy
    "RETRY_BACKOFF_BASE": ("E004", _number(seconds=True)),
    "RETRY_BACKOFF_MULTIPLIER": ("E004", _number()),
    "RETRY_BACKOFF_MAX": ("E004", _number(seconds=True)),
    "RETRY_BACKOFF_JITTER": ("E010", _boolean),
    "DEFAULT_MAX_RETRIES": ("E004", _number(integer=True)),
    "DEFAULT_TIMEOUT": ("E004", _number(positive=True, optional=True, seconds=True)),
    "LEASE_TIMEOUT": ("E004", _number(positive=True, seconds=True)),
    "ABORT_GRACE": ("E004", _number(seconds=True)),
    "DEAD_LETTER_QUEUE": ("E010", _optional_name),
    "IDEMPOTENCY_TTL": ("E004", _number(seconds=True)),
    "IDEMPOTENCY_CACHE": ("E010", _name),
    "SIGNING_KEY": ("E011", _signing_key),
    "SIGNING_KEY_FALLBACKS": ("E011", signing.keys_problem),
    "VERIFY_SIGNATURE": ("E011", _boolean),
    "HANDLERS": ("E010", _handlers),
    "QUEUE_HANDLERS": ("E011", _queue_handlers),
    "ALLOWED_SHELL_COMMANDS": ("E011", _names()),
    "ALLOWED_COMMANDS": ("E011", _names()),
    "ALLOWED_EVENTS": ("E011", _names()),
    "URL_ALLOW_PRIVATE_NETWORKS": ("E011", _boolean),
    "IMPORTS": ("E010", _names()),
    "POLL_INTERVAL": ("E004", _number(positive=True, seconds=True)),  # 0 would poll in a busy loop
    "METRICS_COLLECTOR": ("E010", _optional_name),
    "SCHEDULE": ("E010", _dict),
    "LIMITS": ("E015", _dict),  # then each entry, and who enforces it: _limits
    "HISTORY_LIMIT": ("E004", _number(integer=True)),
    "PREFETCH": ("E004", _number(integer=True, positive=True)),
    "MAX_MESSAGE_BYTES": ("E004", _number(integer=True, positive=True)),
}


@checks.register(checks.Tags.compatibility, TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    user = getattr(settings, "JOBS", None)
    if user is not None and not isinstance(user, dict):
        return [_error(f"settings.JOBS must be a dict, not {conf.describe(user)}", "E008")]
    errors = _unknown_keys(user or {})
    bad: set[str] = set()
    for key, (check_id, rule) in RULES.items():
        problem = rule(conf.get(key))
        if problem:
            bad.add(key)
            errors.append(_error(f"{key} {problem}", check_id))
    if conf.get("SIGNING_KEY") is None:
        # The keys are then derived from SECRET_KEY and each of SECRET_KEY_FALLBACKS.
        problem = signing.keys_problem(getattr(settings, "SECRET_KEY_FALLBACKS", ()))
        if problem:
            errors.append(_error(f"SECRET_KEY_FALLBACKS {problem}", "E011", obj="settings.SECRET_KEY_FALLBACKS"))
    for related in (_backends_and_engines, _strategy, _queues, _cache):
        errors += related(bad)
    # What follows reads the @job registrations: the jobs modules first, as a worker imports them.
    unimportable = _import_job_modules(bad, errors)
    for related in (_handlers_and_queues, _limits):
        errors += related(bad)
    errors += _schedule(bad, unimportable)
    return errors


def _unknown_keys(user: dict[Any, Any]) -> list[checks.CheckMessage]:
    errors = []
    for key in user:
        if key not in conf.DEFAULTS:
            hint = did_you_mean(key, conf.DEFAULTS)
            if isinstance(key, str) and key.upper() in conf.DEFAULTS and key != key.upper():
                hint = f"keys are upper case: did you mean {key.upper()!r}?"
            errors.append(_error(f"unknown key {key!r}", "E009", hint=hint))
    return errors


def _backends_and_engines(bad: set[str]) -> list[checks.CheckMessage]:
    from .backends import ENGINES, engine_class

    if "BACKENDS" in bad:
        return []
    errors = []
    backends = conf.get("BACKENDS")
    default = conf.get("DEFAULT_BACKEND")
    if "DEFAULT_BACKEND" not in bad and default not in backends:
        errors.append(
            _error(f"DEFAULT_BACKEND {default!r} is not in BACKENDS", "E001", hint=did_you_mean(default, backends))
        )
    for name, config in backends.items():
        for key in config:
            if key not in BACKEND_KEYS:
                hint = did_you_mean(key, BACKEND_KEYS) or "OPTIONS holds the engine's own settings"
                errors.append(_error(f"BACKENDS[{name!r}] has unknown key {key!r}", "E009", hint=hint))
        engine = config.get("ENGINE", "database")
        try:
            problem = engine_class(engine).options_problem(config.get("OPTIONS") or {})
        except ImproperlyConfigured as exc:
            errors.append(_error(f"backend {name!r}: {exc}", "E002", hint=did_you_mean(engine, ENGINES)))
        except ImportError as exc:
            errors.append(_error(f"backend {name!r}: cannot import its ENGINE: {exc}", "E002"))
        else:
            if problem:
                errors.append(_error(f"backend {name!r} {problem}", "E016"))
    return errors


def _strategy(bad: set[str]) -> list[checks.CheckMessage]:
    strategy = conf.get("RETRY_BACKOFF_STRATEGY")
    if "RETRY_BACKOFF_STRATEGY" in bad or strategy in STRATEGIES:
        return []
    hint = " ".join(filter(None, [did_you_mean(strategy, STRATEGIES), f"Use one of {', '.join(STRATEGIES)}."]))
    return [_error(f"unknown RETRY_BACKOFF_STRATEGY {strategy!r}", "E003", hint=hint)]


def _queues(bad: set[str]) -> list[checks.CheckMessage]:
    if "QUEUES" not in bad and not conf.get("QUEUES"):
        return [_error("QUEUES must list at least one queue", "E005")]
    return []


def _cache(bad: set[str]) -> list[checks.CheckMessage]:
    alias = conf.get("IDEMPOTENCY_CACHE")
    if "IDEMPOTENCY_CACHE" in bad or alias in settings.CACHES:
        return []
    return [_error(f"IDEMPOTENCY_CACHE {alias!r} is not in CACHES", "E007", hint=did_you_mean(alias, settings.CACHES))]


def _handlers_and_queues(bad: set[str]) -> list[checks.CheckMessage]:
    from . import registry

    errors: list[checks.CheckMessage] = []
    known_queues = [] if "QUEUES" in bad else list(conf.get("QUEUES"))  # empty: E005 says it

    def unknown_queue(queue: Any, where: str, obj: Any = "settings.JOBS") -> None:
        if known_queues and queue not in known_queues:
            errors.append(
                _error(
                    f"{where} names queue {queue!r}, which is not in QUEUES",
                    "E012",
                    obj=obj,
                    hint=did_you_mean(queue, known_queues) or f"add it to JOBS['QUEUES'] ({', '.join(known_queues)})",
                )
            )

    for key, handler in sorted(registry.registered().items()):
        defaults = getattr(handler, "defaults", None)
        if isinstance(defaults, dict) and defaults.get("queue") is not None:
            unknown_queue(defaults["queue"], "@job(queue=...)", obj=key)
    if "DEAD_LETTER_QUEUE" not in bad and conf.get("DEAD_LETTER_QUEUE") is not None:
        unknown_queue(conf.get("DEAD_LETTER_QUEUE"), "DEAD_LETTER_QUEUE")
    if "QUEUE_HANDLERS" in bad:
        return errors
    known = set(registry.registered()) | (set() if "HANDLERS" in bad else set(conf.handlers()))
    for queue, allowed in conf.get("QUEUE_HANDLERS").items():
        unknown_queue(queue, "a QUEUE_HANDLERS key")  # its allowlist would guard no real queue
        for key in allowed:
            if "HANDLERS" not in bad and key not in known:
                errors.append(
                    _error(
                        f"QUEUE_HANDLERS[{queue!r}] names unknown handler {key!r}",
                        "E006",
                        hint=did_you_mean(key, known)
                        or "add it to JOBS['HANDLERS'] or register it with @job in an app's jobs module",
                    )
                )
    return errors


def _schedule(bad: set[str], unimportable: set[str]) -> list[checks.CheckMessage]:
    """E014: every problem of every entry of SCHEDULE (bad trigger, time zone or queue, unknown
    job, ...), but not a job of a module that cannot be imported (E013 says why)."""
    if "SCHEDULE" in bad or not conf.get("SCHEDULE"):
        return []
    from . import schedules  # the scheduler's own module, for a project that has a schedule

    return [_error(problem, "E014") for problem in schedules.errors(unimportable)]


def _limits(bad: set[str]) -> list[checks.CheckMessage]:
    """E015: each bad entry of LIMITS; and a limit that the backend its jobs go to by default
    cannot enforce (a worker would refuse to run them rather than run them unlimited)."""
    from . import limits, registry
    from .backends import engine_class

    if "LIMITS" in bad:
        return []
    errors = [_error(problem, "E015") for problem in limits.problems(conf.get("LIMITS"))]
    if errors or {"BACKENDS", "DEFAULT_BACKEND"} & bad:
        return errors
    backends, default = conf.get("BACKENDS"), conf.get("DEFAULT_BACKEND")
    for limit in limits.configured().values():  # after _handlers_and_queues imported the @job modules
        defaults = getattr(registry.registered().get(limit.key.partition(":")[2]), "defaults", None)
        name = ((defaults or {}).get("backend") or default) if limit.kind == "handler" else default
        try:
            enforced = engine_class(backends[name].get("ENGINE", "database")).supports_limits
        except (KeyError, ImproperlyConfigured, ImportError):  # E001, E002 say why
            continue
        if not enforced:
            errors.append(
                _error(
                    f"limit {limits.describe([limit])} cannot be enforced by backend {name!r}, where its jobs go",
                    "E015",
                    hint="limits need the database or Redis engine; dispatch these jobs to such a backend or lift the limit",
                )
            )
    return errors


def _import_job_modules(bad: set[str], errors: list[checks.CheckMessage]) -> set[str]:
    """What a worker imports before its first fetch: each app's ``jobs`` module, then IMPORTS.
    E013 for each that fails, named; returns their names."""
    failed = set()
    modules = [f"{app.name}.jobs" for app in apps.get_app_configs() if module_has_submodule(app.module, "jobs")]
    for module in modules if apps.ready else []:
        try:
            import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever a module raises at import is the problem to report
            failed.add(module)
            errors.append(_error(f"jobs module {module!r} cannot be imported: {summary(exc)}", "E013"))
    for module in [] if "IMPORTS" in bad else conf.get("IMPORTS"):
        try:
            import_module(module)
        except Exception as exc:  # noqa: BLE001 - as above
            failed.add(module)
            errors.append(_error(f"IMPORTS entry {module!r} cannot be imported: {summary(exc)}", "E013"))
    return failed


def _backends_of(engine: str) -> list[tuple[str, dict[str, Any]]]:
    """The name and configuration of each backend of ``engine`` (by its name or its class's
    dotted path); none where ``JOBS`` or its ``BACKENDS`` is malformed (check_settings reports
    that: E008, E010)."""
    from .backends import ENGINES

    if not isinstance(getattr(settings, "JOBS", None) or {}, dict) or RULES["BACKENDS"][1](conf.get("BACKENDS")):
        return []
    found = []
    for name, config in conf.get("BACKENDS").items():
        named = config.get("ENGINE", "database")
        if ENGINES.get(named, named) == ENGINES[engine]:
            found.append((name, config))
    return found


@checks.register(checks.Tags.compatibility, TAG)
def check_servicebus_delivery_count(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Service Bus dead-letters a message on its own once its lock has expired MaxDeliveryCount
    times. A job whose worker dies on every run needs ``max_retries + 2`` deliveries before
    django-jobs fails it (the last one is failed without running, with a failed ``Job`` row), so
    the queues' MaxDeliveryCount must exceed ``DEFAULT_MAX_RETRIES + 1``. Reads settings only: the
    entity's real MaxDeliveryCount is for ``OPTIONS["MAX_DELIVERY_COUNT"]`` to say (Azure's
    default is 10)."""
    backends = _backends_of("servicebus")
    if not backends:
        return []
    retries = conf.get("DEFAULT_MAX_RETRIES")
    if RULES["DEFAULT_MAX_RETRIES"][1](retries):
        return []  # reported by check_settings (E004)
    warnings: list[checks.CheckMessage] = []
    for name, config in backends:
        count = (config.get("OPTIONS") or {}).get("MAX_DELIVERY_COUNT", 10)
        if isinstance(count, int) and not isinstance(count, bool) and count > retries + 1:
            continue
        warnings.append(
            checks.Warning(
                f"backend {name!r}: the queues' MaxDeliveryCount ({count!r}) must exceed DEFAULT_MAX_RETRIES + 1 "
                f"({retries + 1}): Service Bus would dead-letter a job whose worker keeps dying before its retries "
                "are spent, and no failed Job row would record it",
                hint="raise MaxDeliveryCount on the Service Bus queues and set OPTIONS['MAX_DELIVERY_COUNT'] to it, "
                "or lower DEFAULT_MAX_RETRIES",
                obj="settings.JOBS",
                id="django_jobs.W001",
            )
        )
    return warnings


@checks.register(checks.Tags.compatibility, TAG, deploy=True)
def check_backend_persistence(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """A backend whose server keeps nothing on disk loses every queued job when it restarts
    (Redis without AOF or RDB save points). This asks the servers, so it runs only under
    ``manage.py check --deploy``: a plain ``check`` (and every command's start-up) never
    connects. A server that cannot be reached is not reported here (``jobs_health`` says so)."""
    from .backends import get_backend, persistence_warning

    if not isinstance(getattr(settings, "JOBS", None) or {}, dict) or RULES["BACKENDS"][1](conf.get("BACKENDS")):
        return []  # reported by check_settings (E008, E010)
    warnings: list[checks.CheckMessage] = []
    for name in conf.get("BACKENDS"):
        try:
            backend = get_backend(name)
        except (ImproperlyConfigured, ImportError):  # an engine that cannot be built: E002 says why
            continue
        text = persistence_warning(backend)
        if text is not None:
            warnings.append(
                checks.Warning(
                    f"backend {name!r}: {text}",
                    hint="turn on AOF (appendonly yes) or RDB save points on the server, or accept losing "
                    "queued jobs on a restart",
                    obj="settings.JOBS",
                    id="django_jobs.W003",
                )
            )
    return warnings


# The connections a worker process holds at once: its main thread's and its heartbeat's, kept
# for its life, and one its presence thread takes at each beat.
POOLED_CONNECTIONS = 3


@checks.register(checks.Tags.database, TAG)
def check_connection_pools(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """A database backend on a database with Django's connection pool (``OPTIONS["pool"]`` on
    PostgreSQL): each thread of a worker process that queries takes its own connection from the
    pool. One pool smaller than :data:`POOLED_CONNECTIONS` keeps a thread waiting for one: the
    heartbeat, whose leases are then lost, or the presence thread. Reads settings only."""
    warnings: list[checks.CheckMessage] = []
    for name, config in _backends_of("database"):
        alias = (config.get("OPTIONS") or {}).get("DATABASE", "default")
        pool = (settings.DATABASES.get(alias) or {}).get("OPTIONS", {}).get("pool")
        if not pool:
            continue
        options = pool if isinstance(pool, dict) else {}
        size = options.get("max_size") or options.get("min_size", 4)  # psycopg_pool's defaults
        if isinstance(size, int) and size >= POOLED_CONNECTIONS:
            continue
        warnings.append(
            checks.Warning(
                f"backend {name!r}: the connection pool of database {alias!r} holds {size!r} connection(s); a worker "
                f"process takes {POOLED_CONNECTIONS} at once (its main thread's and its heartbeat's for its life, "
                "its presence thread's at each beat), so a thread would wait for one, the heartbeat too, and "
                "running jobs would lose their leases",
                hint=f"give DATABASES[{alias!r}]['OPTIONS']['pool'] a max_size of at least {POOLED_CONNECTIONS}, more "
                "if jobs query the database from threads of their own",
                obj="settings.DATABASES",
                id="django_jobs.W004",
            )
        )
    return warnings
