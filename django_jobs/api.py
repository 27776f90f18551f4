"""Defining and dispatching jobs: ``Jobs.define(...)`` builders and the ``@job`` decorator."""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    NamedTuple,
    ParamSpec,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    overload,
)

from asgiref.sync import markcoroutinefunction
from django.apps import apps
from django.core.signals import setting_changed
from django.utils import timezone

from . import conf, coroutines, limits, registry, signing
from .backends import get_backend
from .backends.base import QueueBackend
from .envelope import (
    MESSAGE_PARENTS,
    RETRY_ROOM,
    Envelope,
    PayloadProblem,
    a_type,
    check_keys,
    check_storable,
    dumps_payload,
    new_id,
    payload_problem,
)
from .exceptions import (
    AbortNotSupported,
    DispatchCancelled,
    InvalidArguments,
    InvalidPayload,
    UnknownJob,
    UnknownQueue,
)
from .retry import MAX_DELAY_SECONDS, RetryPolicy, check_delay
from .signals import emit, job_dispatching

if TYPE_CHECKING:
    from .pipeline import JobContext

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
    # Ids of jobs this one waits for (a list or tuple, as ``retry_on``); per dispatch only.
    depends_on: list[str] | tuple[str, ...] | None
    run_if_parent_fails: bool | None


OPTION_NAMES: tuple[str, ...] = tuple(JobOptions.__annotations__)


class JobDefinition(JobOptions, total=False):
    """What ``@job(...)`` takes: the :class:`JobOptions`, and the limits of the job's handler,
    which hold for every call whatever its options (see :mod:`django_jobs.limits`)."""

    # The most jobs of this handler running at once, across every worker.
    concurrency: int | None
    # The most starts of this handler per period: "100/m" (units s, m, h, d).
    rate: str | None


LIMIT_NAMES = ("concurrency", "rate")


class JobBuilder:
    """A job being defined: chain options, then ``dispatch()``. Immutable steps are not needed:
    a builder is cheap, build a new one per job."""

    def __init__(self, handler: str, payload: object = None) -> None:
        self._handler = handler
        # No payload is an empty object: every backend stores JSON, and the Job table's column
        # is not nullable.
        self._payload = {} if payload is None else payload
        self._opts: dict[str, Any] = {}
        # The @job function this builder calls, if any: the sender of job_dispatching.
        self._function: JobFunction[Any, Any] | None = None
        # Names the argument at fault in a refused payload (a @job's or a @task's call).
        self._argument_problem: Callable[[Any], str | None] | None = None
        # A prepared call (``prepare()``): its arguments are checked against the function's
        # signature when it is built, once it is known whether a parent's result comes first.
        self._check_at_build = False

    def _copy(self) -> JobBuilder:
        """Another builder of the same call and options (a chain or group adds its own)."""
        other = JobBuilder(self._handler, self._payload)
        other._opts = dict(self._opts)
        other._function, other._check_at_build = self._function, self._check_at_build
        other._argument_problem = self._argument_problem
        return other

    def calls(self, argument_problem: Callable[[Any], str | None]) -> JobBuilder:
        """The payload is a function's call: a refused one raises :class:`InvalidArguments`
        with what ``argument_problem(payload)`` says of the argument at fault."""
        self._argument_problem = argument_problem
        return self

    def _set(self, **values: Any) -> JobBuilder:
        self._opts.update(values)
        return self

    def queue(self, name: str) -> JobBuilder:
        return self._set(queue=name)

    def priority(self, value: int) -> JobBuilder:
        """Higher runs sooner (default 0)."""
        return self._set(priority=_check_priority(value))

    def max_retries(self, value: int) -> JobBuilder:
        """Retries after the first run: total runs = ``value + 1``."""
        _check_int("max_retries", value)
        if value < 0:
            raise ValueError("max_retries must not be negative")
        if value > INT_MAX:
            raise ValueError(f"max_retries must be at most {INT_MAX} (what every backend's record holds), not {value}")
        return self._set(max_retries=value)

    def timeout(self, seconds: float | None) -> JobBuilder:
        """Seconds one attempt may run (``None``: the worker's ``DEFAULT_TIMEOUT``; 0: no limit)."""
        return self._set(timeout=_check_timeout(seconds))

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
        """A name for people (the admin, logs): a str of at most 255 characters."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        _check_text("name", name, NAME_MAX_LENGTH)
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

    def depends_on(self, *job_ids: str) -> JobBuilder:
        """Wait until every job of ``job_ids`` finished (added to those already given). The job is
        not counted as a run while it waits; a parent that fails or is cancelled settles it the
        same way, unless :meth:`run_if_parent_fails`. Parents must be on the same backend."""
        parents = dict.fromkeys(self._opts.get("depends_on", ()))
        for job_id in job_ids:
            _check_job_id(job_id)
            parents.setdefault(job_id)
        return self._set(depends_on=list(parents))

    def run_if_parent_fails(self, enabled: bool = True) -> JobBuilder:
        """Run once every parent finished, even when one failed or was cancelled."""
        return self._set(run_if_parent_fails=bool(enabled))

    def _pass_result_of(self, parent_id: str) -> JobBuilder:
        """Wait for ``parent_id`` and get what it returned as the first argument (``chain(...,
        pass_result=True)``; a ``JOBS["HANDLERS"]`` handler reads ``context.parent_result``)."""
        return self.depends_on(parent_id)._set(result_of=parent_id)

    def single_instance(self, enabled: bool = True) -> JobBuilder:
        """Never run two jobs of this handler at once; a second delivery waits."""
        return self._set(single_instance=enabled)

    def options(self, **values: Unpack[JobOptions]) -> JobBuilder:
        """Set several options by keyword (``queue=``, ``priority=``, ... as in ``using()``)."""
        _refuse_unknown(values, "job option(s)")
        given: Mapping[str, Any] = values  # typed by JobOptions; routed to the setters below by name
        for key, value in given.items():
            if key == "retry_on":
                self.retry_on(*value)
            elif key == "depends_on":
                if value is not None:
                    self.depends_on(*_id_list(value))
            elif key == "backoff":
                self.backoff(**value)
            elif key == "name" and value is not None:
                self.named(value)
            elif key in ("max_retries", "scheduled_at", "timeout") or (
                value is not None and key in ("priority", "delay", "idempotency_key")
            ):
                getattr(self, key)(value)  # the setter of that name checks the value
            elif value is not None:
                self._opts[key] = value
        return self

    def build(self) -> Envelope:
        """The signed envelope this builder describes, checked as ``dispatch()`` sends it.

        Sends ``job_dispatching`` first (so a ``build()`` that is never dispatched sends it too):
        its receivers may change the priority, delay or timeout, or cancel the job, which raises
        :class:`~django_jobs.exceptions.DispatchCancelled`.
        """
        opts = self._opts
        defaults = _dispatch_defaults()
        queue = opts.get("queue") or defaults.queue
        if queue not in defaults.queues:
            raise UnknownQueue(f"queue {queue!r} is not in JOBS['QUEUES'] ({', '.join(conf.queues())})")
        _check_idempotency_key(opts.get("idempotency_key"))
        if self._check_at_build and self._function is not None:
            call: dict[str, Any] = cast("dict[str, Any]", self._payload)  # a @job payload: {"args", "kwargs"}
            self._function.check_call(tuple(call["args"]), call["kwargs"], parent_result="result_of" in opts)
        text = self._encoded()
        check_storable(self._payload, text)
        if len(text) > defaults.max_bytes:  # cheap early refusal; the whole message is checked below
            raise InvalidPayload(f"payload of {len(text)} bytes exceeds JOBS['MAX_MESSAGE_BYTES']")
        now = timezone.now()
        priority: int = opts.get("priority", 0)
        timeout: float | None = opts.get("timeout", defaults.timeout)
        available_at = _available_at(opts, now)
        # No request is built when nobody listens (an empty receiver list is checked without a lock).
        # Django matches a sender by identity: an interned key is the object a receiver's literal
        # sender="command" is.
        if job_dispatching.receivers and job_dispatching.has_listeners(
            sender := self._function if self._function is not None else sys.intern(self._handler)
        ):
            request = DispatchRequest(self._handler, self._payload, queue, priority, timeout, available_at, now)
            emit(job_dispatching, sender, request=request)
            if request.cancelled:
                raise DispatchCancelled(request.reason, self._handler)
            priority, timeout, available_at = request._resolved(now, available_at)
        options = {k: opts[k] for k in ("backoff", "retry_on", "single_instance", "keep_result") if opts.get(k)}
        parents: list[str] = list(opts.get("depends_on") or ())
        if parents:
            if len(parents) <= MESSAGE_PARENTS:
                options["parents"] = parents
            for key in ("run_if_parent_fails", "result_of"):
                if opts.get(key):
                    options[key] = opts[key]
        env = Envelope(
            id=new_id(),
            handler=self._handler,
            payload=self._payload,
            queue=queue,
            priority=priority,
            max_retries=opts.get("max_retries", defaults.max_retries),
            name=opts.get("name", ""),
            idempotency_key=opts.get("idempotency_key"),
            timeout=timeout,
            available_at=available_at,
            options=options,
            unlisted_parents=[] if "parents" in options else parents,
        )
        env.signature = signing.sign(env)
        # The cap a worker applies to the whole encoded message: refuse here what it would reject,
        # on this delivery or a retry's (encoded only when a bound of its size, known without
        # encoding, does not fit).
        room = defaults.max_bytes - RETRY_ROOM
        bound = env.size_at_most(len(text))
        if bound is None or bound > room:
            size = len(env.to_bytes())
            if size > room:
                raise InvalidPayload(
                    f"message of {size} bytes exceeds JOBS['MAX_MESSAGE_BYTES'] ({defaults.max_bytes}) "
                    f"less the {RETRY_ROOM} bytes kept for what a retry adds"
                )
        return env

    def _encoded(self) -> str:
        """The payload's JSON, its dict keys all str; for a @job call, a refusal names the
        argument at fault."""
        try:
            text = dumps_payload(self._payload)
            # A @job payload and its kwargs are dicts with str keys (Python keywords are str).
            check_keys(self._payload, text, str_keyed=0 if self._function is None else 2)
            return text
        except InvalidPayload as exc:
            named = self._argument_problem(self._payload) if self._argument_problem is not None else None
            if named is None:
                raise
            raise InvalidArguments(named) from exc

    @property
    def backend_name(self) -> str | None:
        return self._opts.get("backend")

    def dispatch(self, backend: str | None = None) -> str:
        """Enqueue the job and return its id (after commit for non-database backends)."""
        env = self.build()
        get_backend(backend or self.backend_name).submit([env])
        return env.id


def _refuse_unknown(options: Mapping[str, Any], what: str, allowed: tuple[str, ...] = OPTION_NAMES) -> None:
    unknown = set(options) - set(allowed)
    if unknown & set(LIMIT_NAMES):
        raise TypeError(
            f"{' and '.join(sorted(unknown & set(LIMIT_NAMES)))} limit every job of a handler, not one call: "
            "set them in @job(...) or JOBS['LIMITS']"
        )
    if unknown:
        raise TypeError(f"unknown {what}: {', '.join(sorted(unknown))}")


class _Defaults(NamedTuple):
    """What a dispatch reads of ``JOBS``, worked out once per settings (every dispatch asks)."""

    queues: frozenset[str]
    queue: str  # the default queue
    timeout: float | None
    max_retries: int
    max_bytes: int


_defaults: _Defaults | None = None


def _dispatch_defaults() -> _Defaults:
    global _defaults
    if _defaults is None:
        queues = conf.queues()
        _defaults = _Defaults(
            frozenset(queues),
            queues[0],
            conf.get("DEFAULT_TIMEOUT"),
            conf.get("DEFAULT_MAX_RETRIES"),
            conf.get("MAX_MESSAGE_BYTES"),
        )
    return _defaults


def _available_at(opts: dict[str, Any], now: datetime) -> datetime | None:
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


# What the Job table's integer columns hold on every database (a signed 32-bit int): a broker's
# record of a job (a failure, a kept result) must fit there too.
INT_MAX = 2**31 - 1
# The Job table's name and handler columns hold this many characters.
NAME_MAX_LENGTH = HANDLER_MAX_LENGTH = 255


def _check_int(option: str, value: object) -> int:
    """An int option: ``True`` is not one, nor is ``1.5`` (a record would keep ``1``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an int, not {type(value).__name__}")
    return value


def _check_priority(value: object) -> int:
    """A ``priority`` option: an int that a record can hold."""
    value = _check_int("priority", value)
    if not -INT_MAX - 1 <= value <= INT_MAX:
        raise ValueError(f"priority must be between {-INT_MAX - 1} and {INT_MAX}, not {value}")
    return value


def _check_text(option: str, value: str, limit: int) -> None:
    """A text option that the Job table keeps: at most ``limit`` characters, no U+0000."""
    if len(value) > limit:
        raise ValueError(f"{option} of {len(value)} characters is too long: at most {limit}")
    if "\x00" in value:
        raise ValueError(f"{option} contains U+0000, which PostgreSQL cannot store")


# The Job table's id column holds this many characters: a longer id names no job.
JOB_ID_MAX_LENGTH = 64


def _check_job_id(value: object) -> None:
    """A parent's id, as ``dispatch()`` returned it: a non-empty str of at most 64 characters."""
    if not isinstance(value, str):
        raise TypeError(f"depends_on takes job ids (str), not {type(value).__name__}")
    if not value or len(value) > JOB_ID_MAX_LENGTH or "\x00" in value:
        raise ValueError(f"{value[:80]!r} is not a job id (a non-empty str of at most {JOB_ID_MAX_LENGTH} characters)")


def _id_list(value: object) -> list[str]:
    """``depends_on=``: a list or tuple of ids (a single str would be taken letter by letter)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"depends_on must be a list of job ids, not {type(value).__name__}")
    return list(value)


def _check_timeout(value: float | None) -> float | None:
    """A ``timeout`` option: ``None``, or seconds as for a delay (0: no limit). Kept as given."""
    if value is not None:
        check_delay(value, "timeout")
    return value


def _check_schedule(when: datetime, now: datetime) -> datetime:
    """``scheduled_at`` (aware) as the job keeps it, beside ``now`` (``timezone.now()``): in
    UTC, or naive in the default time zone when ``USE_TZ`` is off (``now`` is naive then, as
    Django keeps every time). It may lie in the past (the job is due at once), but not more
    than ``MAX_DELAY_SECONDS`` ahead."""
    if timezone.is_naive(now):
        when = timezone.make_naive(when, timezone.get_default_timezone())
    else:  # any offset the database can read: one of seconds and microseconds cannot be written
        when = when.astimezone(UTC)
    if when - now > timedelta(seconds=MAX_DELAY_SECONDS):
        raise ValueError(
            f"scheduled_at {when.isoformat()} is too far ahead: at most {MAX_DELAY_SECONDS} seconds (365 days)"
        )
    return when


class DispatchRequest:
    """A job about to be sent, as ``job_dispatching`` receivers get it (``request=``).

    ``handler``, ``payload`` and ``queue`` are read-only (the payload is already encoded: do not
    change it in place). ``priority``, ``delay`` (seconds from now until the job is due, ``None``
    for at once) and ``timeout`` may be set; ``cancel(reason)`` stops the dispatch. New values are
    checked as the builder checks its own once every receiver has run: a bad one makes the
    dispatch raise (a receiver's own exception is only logged).
    """

    __slots__ = ("_delay", "_delay_set", "_handler", "_payload", "_queue", "_reason", "priority", "timeout")

    def __init__(
        self,
        handler: str,
        payload: Any,
        queue: str,
        priority: int,
        timeout: float | None,
        available_at: datetime | None,
        now: datetime,
    ) -> None:
        self._handler, self._payload, self._queue = handler, payload, queue
        self.priority: int = priority
        self.timeout: float | None = timeout
        self._delay: float | timedelta | None = (
            None if available_at is None else max((available_at - now).total_seconds(), 0.0)
        )
        self._delay_set = False
        self._reason: str | None = None

    @property
    def handler(self) -> str:
        """The handler key (a ``@job`` function's dotted path, or a ``JOBS["HANDLERS"]`` key)."""
        return self._handler

    @property
    def payload(self) -> Any:
        """The payload as it will be sent (``{"args": [...], "kwargs": {...}}`` for a ``@job``)."""
        return self._payload

    @property
    def queue(self) -> str:
        return self._queue

    @property
    def delay(self) -> float | timedelta | None:
        """Seconds until the job is due (``None``: at once). Setting it replaces ``scheduled_at``."""
        return self._delay

    @delay.setter
    def delay(self, seconds: float | timedelta | None) -> None:
        self._delay, self._delay_set = seconds, True

    def cancel(self, reason: str = "") -> None:
        """Send nothing: ``dispatch()`` raises ``DispatchCancelled(reason)``; ``Jobs.bulk`` leaves it out."""
        self._reason = reason

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str:
        """Why it was cancelled (``""`` when not, or when no reason was given)."""
        return self._reason or ""

    def _resolved(self, now: datetime, available_at: datetime | None) -> tuple[int, float | None, datetime | None]:
        """The priority, timeout and due time to send, each checked as the builder checks it."""
        try:
            priority = _check_priority(self.priority)
            timeout = _check_timeout(self.timeout)
            if self._delay_set:
                delay = self._delay
                available_at = None if delay is None else now + timedelta(seconds=_delay_seconds(delay))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"a job_dispatching receiver set a bad value: {exc}") from exc
        return priority, timeout, available_at


# The Job table's column holds this many characters; longer keys are refused at dispatch.
IDEMPOTENCY_KEY_MAX_LENGTH = 255


def _check_idempotency_key(key: object) -> None:
    if key is None:
        return
    if not isinstance(key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(key).__name__}")
    _check_text("idempotency_key", key, IDEMPOTENCY_KEY_MAX_LENGTH)


class Jobs:
    """Entry points: ``Jobs.define(handler, payload)``, ``Jobs.bulk(...)``, ``Jobs.backend()``,
    ``Jobs.abort(job_id)``."""

    @staticmethod
    def define(handler: str, payload: object = None) -> JobBuilder:
        """Start defining a job for ``handler`` (a ``JOBS["HANDLERS"]`` key or ``@job`` path).

        ``payload`` is any JSON value; none (``None``) is sent as an empty object, ``{}``."""
        if not isinstance(handler, str) or not handler:
            raise TypeError(f"handler must be a non-empty str, not {handler!r}")
        _check_text("handler", handler, HANDLER_MAX_LENGTH)
        return JobBuilder(handler, payload)

    @staticmethod
    def bulk(jobs: Iterable[JobBuilder], backend: str | None = None) -> list[str]:
        """Dispatch many jobs at once (one INSERT on the database backend); returns their ids.

        Every job goes to ``backend`` (default: the default backend); per-builder backends
        are ignored so a batch stays one round trip. A job that a ``job_dispatching`` receiver
        cancels is left out: the ids are those of the jobs sent.
        """
        envelopes = []
        for builder in jobs:
            try:
                envelopes.append(builder.build())
            except DispatchCancelled:
                continue
        if envelopes:
            get_backend(backend).submit(envelopes)
        return [e.id for e in envelopes]

    @staticmethod
    def abort(job_id: str, requested_by: str = "api") -> Literal["cancelled", "aborting", "finished"]:
        """Stop a job: ``"cancelled"`` when it was waiting (it never runs); ``"aborting"`` when it
        is running (its worker sees the request within about a second and stops it, within
        ``ABORT_GRACE`` more, and it ends ``cancelled``; also when it was asked before, and the
        first request stands); ``"finished"`` when it had already ended (it is left alone).

        ``requested_by`` (1 to 150 characters, else ``ValueError``) is recorded with the
        cancelled attempt. Raises ``UnknownJob`` when no database or backend holds the job, and
        ``AbortNotSupported`` when it may be on a backend that cannot abort a job by its id
        (beanstalkd, Azure Service Bus, sync). The job itself sees the abort as
        ``context.aborted`` (``django_jobs.current_job().aborted`` in a ``@job`` function)."""
        from .operations import abort_jobs  # the models load after the app registry

        outcome = abort_jobs([job_id], requested_by)
        if outcome.cancelled:
            return "cancelled"
        if outcome.asked or outcome.already:
            return "aborting"
        if outcome.finished:
            return "finished"
        if outcome.unsupported:
            names = ", ".join(repr(name) for name in outcome.unsupported)
            raise AbortNotSupported(f"job {job_id!r} not found; backend(s) {names} cannot abort a job by its id")
        raise UnknownJob("; ".join([f"no job with id {job_id!r}", *outcome.errors]))

    @staticmethod
    def backend(name: str | None = None) -> QueueBackend:
        """The configured backend instance (the default one when ``name`` is ``None``)."""
        return get_backend(name)


class JobFunction(Generic[P, R]):
    """A function registered by ``@job``: still callable directly, plus ``dispatch()``.

    It keeps the function's signature: ``dispatch()``, ``builder()`` and a direct call take the
    function's own arguments, and a direct call returns what the function returns (a coroutine,
    for an ``async def`` function: ``is_async``, and ``iscoroutinefunction()`` says so too)."""

    def __init__(self, func: Callable[P, R], options: JobDefinition) -> None:
        functools.update_wrapper(self, func)
        self.func = func
        self.key = f"{func.__module__}.{func.__qualname__}"
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@job cannot run {self.key}: it is a generator function, whose body runs only when "
                "something iterates it; return a value instead of yielding"
            )
        self.is_async = coroutines.is_async(func)
        if self.is_async:
            markcoroutinefunction(self)
        defined: Mapping[str, Any] = options
        self.defaults: JobOptions = cast(JobOptions, {k: v for k, v in defined.items() if k not in LIMIT_NAMES})
        limits.declare(self.key, concurrency=options.get("concurrency"), rate=options.get("rate"))
        self.signature = inspect.signature(func)
        registry.register(self.key, self)

    def check_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, partial: bool = False, parent_result: bool = False
    ) -> None:
        """Refuse at dispatch what would only fail in the worker: arguments that do not fit the
        function's signature, and a function no worker process imports (see :func:`_check_importable`).

        ``parent_result``: a parent's result comes first (``chain(..., pass_result=True)``);
        ``partial``: arguments may be missing (a prepared call, checked in full when built)."""
        if self not in _importable:
            _check_importable(self)
        try:
            if partial:
                self.signature.bind_partial(*args, **kwargs)
            else:
                self.signature.bind(*((None,) if parent_result else ()), *args, **kwargs)
        except TypeError as exc:
            passed = " (after the parent's result, its first argument)" if parent_result else ""
            raise TypeError(f"{self.key}(): {exc}{passed}") from None

    def argument_problem(self, payload: Any) -> str | None:
        """Which argument of a refused ``{"args", "kwargs"}`` payload cannot travel as JSON, and
        what to pass instead; ``None`` when no argument is at fault."""
        return argument_problem(self.key, self.signature, payload)

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
        args = payload.get("args", [])
        if "result_of" in context.envelope.options:  # a chain's step: its parent's result first
            args = [context.parent_result, *args]
        return self.func(*args, **payload.get("kwargs", {}))

    def using(self, **options: Unpack[JobOptions]) -> BoundJob[P, R]:
        """Override options for one dispatch: ``queue``, ``priority``, ``max_retries``,
        ``timeout``, ``delay``, ``scheduled_at``, ``idempotency_key``, ``name``, ``backend``,
        ``depends_on`` (parent job ids to wait for) and ``run_if_parent_fails``."""
        _refuse_unknown(options, "job option(s)")
        return BoundJob(self, {**self.defaults, **options})

    def builder(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """A :class:`JobBuilder` for this call, not yet sent (e.g. for ``Jobs.bulk``)."""
        return self._plain().builder(*args, **kwargs)

    def prepare(self, *args: Any, **kwargs: Any) -> JobBuilder:
        """An unsent call, for :func:`~django_jobs.chain` and :func:`~django_jobs.group` (or
        ``dispatch()`` it). In a ``chain(..., pass_result=True)`` the previous step's result
        becomes its first argument: leave that one out here."""
        return self._plain().prepare(*args, **kwargs)

    def build(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """Deprecated: ``builder()``. (``JobBuilder.build()`` returns an envelope, not a builder.)"""
        _warn_build_renamed()
        return self.builder(*args, **kwargs)

    def dispatch(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Enqueue a call; returns the job id."""
        return self._plain().dispatch(*args, **kwargs)

    def _plain(self) -> BoundJob[P, R]:
        """``using()`` with no options of the call's own, made once."""
        bound = _plain.get(self)
        if bound is None:
            bound = _plain[self] = self.using()
        return bound


class BoundJob(Generic[P, R]):
    """A ``@job`` function with per-dispatch options (from ``using()``)."""

    def __init__(self, function: JobFunction[P, R], options: JobOptions) -> None:
        self.function, self.options = function, options
        # The builder options these make, checked once per settings (``_generation``).
        self._checked: tuple[int, dict[str, Any]] | None = None

    def builder(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """A :class:`JobBuilder` for this call, not yet sent (e.g. for ``Jobs.bulk``)."""
        self.function.check_call(args, kwargs)
        return self._builder(args, kwargs)

    def prepare(self, *args: Any, **kwargs: Any) -> JobBuilder:
        """An unsent call with these options (see :meth:`JobFunction.prepare`)."""
        self.function.check_call(args, kwargs, partial=True)
        builder = self._builder(args, kwargs)
        builder._check_at_build = True
        return builder

    def _builder(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> JobBuilder:
        builder = JobBuilder(self.function.key, {"args": list(args), "kwargs": kwargs})
        builder._function = self.function
        builder.calls(self.function.argument_problem)
        if self._checked is None or self._checked[0] != _generation:
            options: JobOptions = {"name": self.function.key, **self.options}
            self._checked = _generation, JobBuilder(self.function.key).options(**options)._opts
        builder._opts = dict(self._checked[1])
        return builder

    def build(self, *args: P.args, **kwargs: P.kwargs) -> JobBuilder:
        """Deprecated: ``builder()``. (``JobBuilder.build()`` returns an envelope, not a builder.)"""
        _warn_build_renamed()
        return self.builder(*args, **kwargs)

    def dispatch(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Enqueue a call; returns the job id."""
        return self.builder(*args, **kwargs).dispatch()


def argument_problem(key: str, signature: inspect.Signature, payload: Any) -> str | None:
    """Which argument of the call ``{"args", "kwargs"}`` of ``key`` (with ``signature``) cannot
    travel as JSON, and what to pass instead; ``None`` when no argument is at fault."""
    try:
        bound = signature.bind(*payload["args"], **payload["kwargs"])
    except (TypeError, KeyError):
        return None
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:  # each extra keyword is an argument of its own
            named = list(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named = [(f"{name}[{index}]", item) for index, item in enumerate(value)]
        else:
            named = [(name, value)]
        for label, item in named:
            problem = payload_problem(item, label)
            if problem is not None:
                return f"{key}(): {_describe_argument(label, item, problem)}"
    return None


def _describe_argument(label: str, value: Any, problem: PayloadProblem) -> str:
    """``argument 'user' (a User) is not JSON-serialisable; pass user.pk and load it in the job``."""
    if problem.is_key:
        return f"argument {label!r} has a dict key that is not a str: {problem.text}; use str keys"
    if isinstance(problem.culprit, float):  # NaN or Infinity: the text says so
        return f"argument {label!r} is not JSON-serialisable: {problem.text}"
    if problem.where == label:
        what = f"argument {label!r} ({a_type(value)}) is not JSON-serialisable"
    else:
        what = f"argument {label!r} is not JSON-serialisable: {problem.text}"
    if hasattr(problem.culprit, "pk"):  # a model instance: its id travels, the job loads it
        return f"{what}; pass {problem.where}.pk and load it in the job"
    return f"{what}; pass JSON values (str, int, float, bool, None, and lists and str-keyed dicts of them)"


# -- which modules a worker imports -----------------------------------------------------------------

# @job functions found importable by a worker, for the current settings (forgotten when
# JOBS, INSTALLED_APPS or TASKS change): the check runs once per function.
_importable: set[JobFunction[Any, Any]] = set()


# Each @job function with its own options only (``using()`` with none), made once.
_plain: dict[JobFunction[Any, Any], BoundJob[Any, Any]] = {}
# Counts the changes of the JOBS settings: options checked before the last one are checked
# again (the settings, a backoff's among them, decide what is valid).
_generation = 0


def _forget_settings(*, setting: str, **kwargs: Any) -> None:
    global _defaults, _generation
    if setting in ("JOBS", "INSTALLED_APPS", "TASKS"):
        _importable.clear()
    if setting == "JOBS":
        _defaults = None
        _generation += 1


setting_changed.connect(_forget_settings)


def _check_importable(function: JobFunction[Any, Any]) -> None:
    """Refuse a ``@job`` function a worker would not know: a worker registers jobs by importing
    modules, and runs only what those imports registered.

    A function is importable when its module is an installed app's ``jobs`` module (or under it),
    in (or under) ``JOBS["IMPORTS"]``, an app's ``tasks`` module (or under it) when ``TASKS`` uses
    django-jobs' backend, or when one of those modules holds it as an attribute (a re-export:
    ``from .emails import send_welcome`` in ``jobs.py``). The answer is kept per function.
    """
    module = function.func.__module__
    if "<locals>" in function.func.__qualname__ or module == "__main__":
        raise TypeError(
            f"{function.key} cannot be dispatched: a worker imports jobs by their dotted path, and a "
            "function defined inside another function or in __main__ has none; define it at the "
            "top level of an app's jobs module or of a module listed in JOBS['IMPORTS']"
        )
    if not apps.ready:
        return  # which modules are apps' is not known yet; checked on a later dispatch
    roots = _worker_modules()
    in_place = any(module == root or module.startswith(f"{root}.") for root in roots)
    if not in_place and not _reexported(function, roots):
        app = apps.get_containing_app_config(module)
        where = f"{app.name.replace('.', '/')}/jobs.py" if app is not None else "<app>/jobs.py"
        raise TypeError(
            f"{function.key} cannot be dispatched: a worker would not import its module {module!r}, so it "
            f"would not know this job; move the function to {where} (an installed app's jobs module) or "
            f"add {module!r} to JOBS['IMPORTS']"
        )
    _importable.add(function)


def _worker_modules() -> list[str]:
    """The modules a worker imports before its first fetch (and whose submodules count)."""
    configs = apps.get_app_configs()
    roots = [f"{config.name}.jobs" for config in configs]
    if registry.tasks_use_django_jobs():
        roots += [f"{config.name}.tasks" for config in configs]
    return roots + conf.names("IMPORTS")


def _reexported(function: JobFunction[Any, Any], roots: list[str]) -> bool:
    """Whether a module a worker imports holds ``function`` (imported there from elsewhere).
    Those modules are imported here first, as a worker imports them."""
    registry.autodiscover()
    return any(
        any(value is function for value in vars(module).values())
        for module in (sys.modules.get(root) for root in roots)
        if module is not None
    )


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
def job(func: None = None, /, **options: Unpack[JobDefinition]) -> Callable[[Callable[P, R]], JobFunction[P, R]]: ...


def job(
    func: Callable[P, R] | None = None, **options: Unpack[JobDefinition]
) -> JobFunction[P, R] | Callable[[Callable[P, R]], JobFunction[P, R]]:
    """Register a function as a job handler (under its dotted path). Bare ``@job`` works too.

    Options are :class:`JobOptions`, the builder's: ``queue``, ``priority``, ``max_retries``,
    ``timeout``, ``backoff`` (dict), ``retry_on`` (exception classes), ``single_instance``,
    ``backend``, ``name``; and the handler's limits, ``concurrency`` (jobs running at once) and
    ``rate`` (``"100/m"``), enforced across every worker. The result keeps the function's
    signature, so a type checker checks ``dispatch()`` arguments against it and a misspelled option.
    """
    _refuse_unknown(options, "@job option(s)", OPTION_NAMES + LIMIT_NAMES)
    if "depends_on" in options:
        raise TypeError("depends_on names the parents of one dispatch: pass it to using(), not @job")

    def wrap(f: Callable[P, R]) -> JobFunction[P, R]:
        return JobFunction(f, options)

    return wrap(func) if func is not None else wrap
