"""Defining and dispatching jobs: ``Jobs.define(...)`` builders and the ``@job`` decorator."""

from __future__ import annotations

import functools
import inspect
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, TypedDict, TypeVar, Unpack, overload

from django.utils import timezone

from . import conf, registry, signing
from .backends import get_backend
from .backends.base import QueueBackend
from .envelope import Envelope, dumps_payload, new_id
from .exceptions import InvalidPayload, UnknownQueue
from .retry import MAX_DELAY_SECONDS, RetryPolicy, check_delay

if TYPE_CHECKING:
    from .pipeline import JobContext

# A JSON-escaped U+0000: "\u0000" after an even number of backslashes.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
P = ParamSpec("P")
R = TypeVar("R")


class BackoffOptions(TypedDict, total=False):
    """A job's own retry policy (``backoff=``), over the global ``RETRY_BACKOFF_*`` settings."""

    strategy: Literal["none", "fixed", "exponential", "full_jitter"]
    base: float
    multiplier: float
    max: float
    jitter: bool


class JobOptions(TypedDict, total=False):
    """The options ``@job(...)``, ``using(...)`` and ``JobBuilder.options(...)`` take by keyword.

    ``None`` is accepted where it leaves the option unset (``timeout=None`` is kept: the
    worker's ``DEFAULT_TIMEOUT`` applies). Unknown names raise ``TypeError`` at run time too.
    """

    queue: str | None
    priority: int | None
    max_retries: int
    timeout: float | None
    delay: float | timedelta | None
    scheduled_at: datetime
    idempotency_key: str | None
    name: str | None
    backend: str | None
    backoff: BackoffOptions
    # A list or tuple, not any sequence: a str would be taken letter by letter.
    retry_on: list[type[BaseException] | str] | tuple[type[BaseException] | str, ...]
    single_instance: bool | None
    keep_result: bool | None


OPTION_NAMES: tuple[str, ...] = tuple(JobOptions.__annotations__)


class JobBuilder:
    """A job being defined: chain options, then ``dispatch()``. Immutable steps are not needed:
    a builder is cheap, build a new one per job."""

    def __init__(self, handler: str, payload: object = None) -> None:
        self._handler = handler
        # No payload is an empty object: every backend stores JSON, and the Job table's column
        # is not nullable.
        self._payload = {} if payload is None else payload
        self._opts: dict[str, Any] = {}

    def _set(self, **values: Any) -> JobBuilder:
        self._opts.update(values)
        return self

    def queue(self, name: str) -> JobBuilder:
        return self._set(queue=name)

    def priority(self, value: int) -> JobBuilder:
        """Higher runs sooner (default 0)."""
        return self._set(priority=int(value))

    def max_retries(self, value: int) -> JobBuilder:
        """Retries after the first run: total runs = ``value + 1``."""
        if value < 0:
            raise ValueError("max_retries must not be negative")
        return self._set(max_retries=int(value))

    def timeout(self, seconds: float | None) -> JobBuilder:
        """Seconds one attempt may run."""
        return self._set(timeout=seconds)

    def delay(self, seconds: float | timedelta) -> JobBuilder:
        """Run no sooner than ``seconds`` from dispatch (at most ``MAX_DELAY_SECONDS``, one year)."""
        _delay_seconds(seconds)  # refused now, not at dispatch
        return self._set(delay=seconds)

    def scheduled_at(self, when: datetime) -> JobBuilder:
        """Run no sooner than ``when`` (an aware datetime, at most a year ahead)."""
        if not isinstance(when, datetime):
            raise TypeError(f"scheduled_at needs an aware datetime, not {type(when).__name__}")
        if timezone.is_naive(when):
            raise ValueError("scheduled_at needs an aware datetime")
        _check_schedule(when, timezone.now())
        return self._set(scheduled_at=when)

    def idempotency_key(self, key: str) -> JobBuilder:
        """Once a run with this key succeeds, later deliveries with it are skipped."""
        _check_idempotency_key(key)
        return self._set(idempotency_key=key)

    def named(self, name: str) -> JobBuilder:
        return self._set(name=name)

    def backoff(self, **policy: Unpack[BackoffOptions]) -> JobBuilder:
        """This job's own retry policy: ``strategy``, ``base``, ``multiplier``, ``max``, ``jitter``."""
        unknown = set(policy) - {"strategy", "base", "multiplier", "max", "jitter"}
        if unknown:
            raise TypeError(f"unknown backoff option(s): {', '.join(sorted(unknown))}")
        for name in ("base", "max"):
            if name in policy:
                check_delay(policy[name], f"backoff {name}")
        multiplier = policy.get("multiplier")
        if isinstance(multiplier, float) and not math.isfinite(multiplier):
            raise ValueError(f"backoff multiplier must be a finite number, not {multiplier!r}")
        RetryPolicy.from_settings(**policy)  # validate now, not in the worker
        return self._set(backoff=policy)

    def retry_on(self, *exceptions: type[BaseException] | str) -> JobBuilder:
        """Retry only when the error is one of these exception classes (or a subclass)."""
        names = [e if isinstance(e, str) else f"{e.__module__}.{e.__qualname__}" for e in exceptions]
        return self._set(retry_on=names)

    def keep_result(self, enabled: bool = True) -> JobBuilder:
        """Keep what the job returns (JSON) and its completed attempt in the history."""
        return self._set(keep_result=enabled)

    def single_instance(self, enabled: bool = True) -> JobBuilder:
        """Never run two jobs of this handler at once; a second delivery waits."""
        return self._set(single_instance=enabled)

    def options(self, **values: Unpack[JobOptions]) -> JobBuilder:
        """Set several options by keyword (``queue=``, ``priority=``, ... as in ``using()``)."""
        unknown = set(values) - set(OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown job option(s): {', '.join(sorted(unknown))}")
        given: Mapping[str, Any] = values  # typed by JobOptions; routed to the setters below by name
        for key, value in given.items():
            if key == "retry_on":
                self.retry_on(*value)
            elif key == "backoff":
                self.backoff(**value)
            elif key == "scheduled_at":
                self.scheduled_at(value)
            elif key == "max_retries":
                self.max_retries(value)
            elif value is not None or key in ("timeout",):
                self._opts[key] = value
        return self

    def build(self) -> Envelope:
        """The signed envelope this builder describes."""
        opts = self._opts
        queue = opts.get("queue") or conf.default_queue()
        if queue not in conf.queues():
            raise UnknownQueue(f"queue {queue!r} is not in JOBS['QUEUES'] ({', '.join(conf.queues())})")
        _check_idempotency_key(opts.get("idempotency_key"))
        text = dumps_payload(self._payload)
        if _ESCAPED_NUL.search(text):
            raise InvalidPayload("payload contains U+0000, which PostgreSQL cannot store; encode binary data")
        if len(text) > conf.get("MAX_MESSAGE_BYTES"):  # cheap early refusal; the whole message is checked below
            raise InvalidPayload(f"payload of {len(text)} bytes exceeds JOBS['MAX_MESSAGE_BYTES']")
        options = {k: opts[k] for k in ("backoff", "retry_on", "single_instance", "keep_result") if opts.get(k)}
        env = Envelope(
            id=new_id(),
            handler=self._handler,
            payload=self._payload,
            queue=queue,
            priority=opts.get("priority", 0),
            max_retries=opts.get("max_retries", conf.get("DEFAULT_MAX_RETRIES")),
            name=opts.get("name", ""),
            idempotency_key=opts.get("idempotency_key"),
            timeout=opts.get("timeout", conf.get("DEFAULT_TIMEOUT")),
            available_at=_available_at(opts),
            options=options,
        )
        env.signature = signing.sign(env)
        # The cap a worker applies to the whole encoded message: refuse here what it would reject.
        size = len(env.to_bytes())
        if size > conf.get("MAX_MESSAGE_BYTES"):
            raise InvalidPayload(f"message of {size} bytes exceeds JOBS['MAX_MESSAGE_BYTES']")
        return env

    @property
    def backend_name(self) -> str | None:
        return self._opts.get("backend")

    def dispatch(self, backend: str | None = None) -> str:
        """Enqueue the job and return its id (after commit for non-database backends)."""
        env = self.build()
        get_backend(backend or self.backend_name).submit([env])
        return env.id


def _available_at(opts: dict[str, Any]) -> datetime | None:
    now: datetime = timezone.now()
    if opts.get("scheduled_at") is not None:
        # Checked again here: a builder may be dispatched long after scheduled_at() was called.
        return _check_schedule(opts["scheduled_at"], now)
    delay = opts.get("delay")
    if delay is None:
        return None
    return now + timedelta(seconds=_delay_seconds(delay))


def _delay_seconds(delay: float | timedelta) -> float:
    """A ``delay`` option in seconds: finite, not negative, at most ``MAX_DELAY_SECONDS``."""
    return check_delay(delay.total_seconds() if isinstance(delay, timedelta) else delay, "delay")


def _check_schedule(when: datetime, now: datetime) -> datetime:
    """``scheduled_at`` may lie in the past (the job is due at once), but not more than
    ``MAX_DELAY_SECONDS`` ahead."""
    if when - now > timedelta(seconds=MAX_DELAY_SECONDS):
        raise ValueError(
            f"scheduled_at {when.isoformat()} is too far ahead: at most {MAX_DELAY_SECONDS} seconds (365 days)"
        )
    return when


# The Job table's column holds this many characters; longer keys are refused at dispatch.
IDEMPOTENCY_KEY_MAX_LENGTH = 255


def _check_idempotency_key(key: object) -> None:
    if key is None:
        return
    if not isinstance(key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(key).__name__}")
    if len(key) > IDEMPOTENCY_KEY_MAX_LENGTH:
        raise ValueError(f"idempotency_key of {len(key)} characters is too long: at most {IDEMPOTENCY_KEY_MAX_LENGTH}")
    if "\x00" in key:
        raise ValueError("idempotency_key contains U+0000, which PostgreSQL cannot store")


class Jobs:
    """Entry points: ``Jobs.define(handler, payload)``, ``Jobs.bulk(...)``, ``Jobs.backend()``."""

    @staticmethod
    def define(handler: str, payload: object = None) -> JobBuilder:
        """Start defining a job for ``handler`` (a ``JOBS["HANDLERS"]`` key or ``@job`` path).

        ``payload`` is any JSON value; none (``None``) is sent as an empty object, ``{}``."""
        return JobBuilder(handler, payload)

    @staticmethod
    def bulk(jobs: Iterable[JobBuilder], backend: str | None = None) -> list[str]:
        """Dispatch many jobs at once (one INSERT on the database backend); returns their ids.

        Every job goes to ``backend`` (default: the default backend); per-builder backends
        are ignored so a batch stays one round trip.
        """
        envelopes = [builder.build() for builder in jobs]
        if envelopes:
            get_backend(backend).submit(envelopes)
        return [e.id for e in envelopes]

    @staticmethod
    def backend(name: str | None = None) -> QueueBackend:
        """The configured backend instance (the default one when ``name`` is ``None``)."""
        return get_backend(name)


class JobFunction(Generic[P, R]):
    """A function registered by ``@job``: still callable directly, plus ``dispatch()``.

    It keeps the function's signature: ``dispatch()``, ``builder()`` and a direct call take the
    function's own arguments, and a direct call returns what the function returns."""

    def __init__(self, func: Callable[P, R], options: JobOptions) -> None:
        functools.update_wrapper(self, func)
        self.func = func
        self.key = f"{func.__module__}.{func.__qualname__}"
        self.defaults = options
        self.signature = inspect.signature(func)
        registry.register(self.key, self)

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse at dispatch what would only fail in the worker: arguments that do not fit the
        function's signature, and a function no worker process can import by its dotted path."""
        if "<locals>" in self.func.__qualname__ or self.func.__module__ == "__main__":
            raise TypeError(
                f"{self.key} cannot be dispatched: a worker imports jobs by their dotted path, and a "
                "function defined inside another function or in __main__ has none; define it at the "
                "top level of an app's jobs module or of a module listed in JOBS['IMPORTS']"
            )
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.key}(): {exc}") from None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    def handle(self, context: JobContext) -> R:
        payload = context.payload
        if (
            not isinstance(payload, dict)
            or not isinstance(payload.get("args", []), list)
            or not isinstance(payload.get("kwargs", {}), dict)
        ):
            raise InvalidPayload("a @job payload must be {'args': [...], 'kwargs': {...}}")
        return self.func(*payload.get("args", []), **payload.get("kwargs", {}))

    def using(self, **options: Unpack[JobOptions]) -> BoundJob[P, R]:
        """Override options for one dispatch: ``queue``, ``priority``, ``max_retries``,
        ``timeout``, ``delay``, ``scheduled_at``, ``idempotency_key``, ``name``, ``backend``."""
        return BoundJob(self, {**self.defaults, **options})

    def builder(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """A :class:`JobBuilder` for this call, not yet sent (e.g. for ``Jobs.bulk``)."""
        return self.using().builder(*args, **kwargs)

    def build(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """Deprecated: ``builder()``. (``JobBuilder.build()`` returns an envelope, not a builder.)"""
        _warn_build_renamed()
        return self.builder(*args, **kwargs)

    def dispatch(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Enqueue a call; returns the job id."""
        return self.using().dispatch(*args, **kwargs)


class BoundJob(Generic[P, R]):
    """A ``@job`` function with per-dispatch options (from ``using()``)."""

    def __init__(self, function: JobFunction[P, R], options: JobOptions) -> None:
        self.function, self.options = function, options

    def builder(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """A :class:`JobBuilder` for this call, not yet sent (e.g. for ``Jobs.bulk``)."""
        self.function.check_call(args, kwargs)
        builder = JobBuilder(self.function.key, {"args": list(args), "kwargs": kwargs})
        options: JobOptions = {"name": self.function.key, **self.options}
        return builder.options(**options)

    def build(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """Deprecated: ``builder()``. (``JobBuilder.build()`` returns an envelope, not a builder.)"""
        _warn_build_renamed()
        return self.builder(*args, **kwargs)

    def dispatch(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Enqueue a call; returns the job id."""
        return self.builder(*args, **kwargs).dispatch()


def _warn_build_renamed() -> None:
    warnings.warn(
        "a @job function's build() is renamed builder() (it returns a JobBuilder); "
        "build() will be removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )


@overload
def job(func: Callable[P, R], /) -> JobFunction[P, R]: ...


@overload
def job(func: None = None, /, **options: Unpack[JobOptions]) -> Callable[[Callable[P, R]], JobFunction[P, R]]: ...


def job(
    func: Callable[P, R] | None = None, **options: Unpack[JobOptions]
) -> JobFunction[P, R] | Callable[[Callable[P, R]], JobFunction[P, R]]:
    """Register a function as a job handler (under its dotted path). Bare ``@job`` works too.

    Options are :class:`JobOptions`, the builder's: ``queue``, ``priority``, ``max_retries``,
    ``timeout``, ``backoff`` (dict), ``retry_on`` (exception classes), ``single_instance``,
    ``backend``, ``name``. The result keeps the function's signature, so a type checker checks
    ``dispatch()`` arguments against it and a misspelled option.
    """
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown @job option(s): {', '.join(sorted(unknown))}")

    def wrap(f: Callable[P, R]) -> JobFunction[P, R]:
        return JobFunction(f, options)

    return wrap(func) if func is not None else wrap
