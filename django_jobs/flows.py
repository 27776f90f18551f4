"""Jobs that wait for other jobs: ``chain(a, b, c)`` and ``group(a, b).then(c)``.

Both are built on dependencies (``using(depends_on=[...])``): every job of a chain or group is
built first (its id is chosen then, so a child names its parent before anything is sent), then
all of them are sent in one ``submit``, which on the database backend is one transaction. The
backend holds each child until its parents finished (see :func:`edges_verdict` for the rule).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from . import conf, history
from .api import JobBuilder
from .backends import get_backend
from .envelope import Envelope
from .exceptions import ParentCancelled, ParentFailed
from .logfields import log_fields

__all__ = ["Chain", "EdgesVerdict", "Group", "chain", "edges_verdict", "group"]


class EdgesVerdict(NamedTuple):
    """What a waiting job's edges say: keep ``waiting``, ``ready`` to run, or settle it
    ``failed``/``cancelled`` with ``reason`` (its ``last_error``) because of ``parent``."""

    state: Literal["waiting", "ready", "failed", "cancelled"]
    parent: str | None = None
    reason: str = ""

    @property
    def error_class(self) -> str:
        """The dotted exception class of a settled job's history entry (``ParentFailed``/``ParentCancelled``)."""
        kind = ParentCancelled if self.state == "cancelled" else ParentFailed
        return f"{kind.__module__}.{kind.__qualname__}"


# The ``worker`` of the history entry of a job settled by its parents, not by a run.
FLOW_WORKER = "flow"
# Every backend logs a job its parents settled under the same name.
logger = logging.getLogger("django_jobs.dependencies")


def record_settled(
    job_id: str, queue: str, handler: str, attempt: int, verdict: EdgesVerdict, using: str | None = None
) -> None:
    """A job its parents settled without running it (after the change is stored): its history
    entry, the run it will not have (attempt ``attempt``, by the ``flow`` worker), and one
    ``WARNING`` record with the job's log fields."""
    history.record(
        job_id,
        attempt,
        verdict.state,
        error=verdict.reason,
        error_class=verdict.error_class,
        worker=FLOW_WORKER,
        using=using,
    )
    extra = log_fields(job_id, queue, handler, attempt, verdict.state)
    logger.warning("job %s %s without running: %s", job_id, verdict.state, verdict.reason, extra=extra)


def edges_verdict(edges: Iterable[tuple[str, str | None]], run_if_parent_fails: bool) -> EdgesVerdict:
    """The fate of a waiting job from its edges, ``(parent id, parent's outcome or None while
    it has not finished)``. Unless ``run_if_parent_fails``, the first parent found failed or
    cancelled settles the job at once, without waiting for the others; otherwise the job is
    ready once every parent finished, however each ended."""
    waiting = False
    for parent, outcome in edges:
        if outcome is None:
            waiting = True
        elif outcome == "failed" and not run_if_parent_fails:
            return EdgesVerdict("failed", parent, ParentFailed.describe(parent))
        elif outcome == "cancelled" and not run_if_parent_fails:
            return EdgesVerdict("cancelled", parent, ParentCancelled.describe(parent))
    return EdgesVerdict("waiting") if waiting else EdgesVerdict("ready")


def _calls(calls: Sequence[JobBuilder], what: str) -> list[JobBuilder]:
    if not calls:
        raise ValueError(f"{what} needs at least one job")
    for call in calls:
        if not isinstance(call, JobBuilder):
            raise TypeError(
                f"{what} takes unsent calls (my_job.prepare(...), Jobs.define(...)), not {type(call).__name__}"
            )
    return list(calls)


def _send(envelopes: list[Envelope], calls: Iterable[JobBuilder], backend: str | None) -> list[str]:
    """Submit ``envelopes`` together to the one backend every call names (or ``backend``)."""
    if backend is None:
        names = {call.backend_name or conf.get("DEFAULT_BACKEND") for call in calls}
        if len(names) > 1:
            raise ValueError(
                f"the jobs of a chain or group must go to one backend, not {', '.join(sorted(names))}: "
                "a job waits only for parents on its own backend"
            )
        backend = names.pop()
    get_backend(backend).submit(envelopes)
    return [envelope.id for envelope in envelopes]


class Chain:
    """Jobs that run one after the other: each waits for the one before it. A step that fails
    for good (or is cancelled) settles every later step the same way, unless that step was
    prepared with ``run_if_parent_fails=True``. ``pass_result``: each step gets what the step
    before it returned as its first argument (every step but the last keeps its result)."""

    def __init__(self, calls: Sequence[JobBuilder], *, pass_result: bool = False) -> None:
        self.calls = _calls(calls, "chain()")
        self.pass_result = pass_result

    def build(self) -> list[Envelope]:
        """The signed envelopes, in order, each naming the one before it as its parent."""
        envelopes: list[Envelope] = []
        last = len(self.calls) - 1
        for index, call in enumerate(self.calls):
            step = call._copy()
            if envelopes:
                if self.pass_result:
                    step._pass_result_of(envelopes[-1].id)
                else:
                    step.depends_on(envelopes[-1].id)
            if self.pass_result and index < last:
                step.keep_result()
            envelopes.append(step.build())
        return envelopes

    def dispatch(self, backend: str | None = None) -> list[str]:
        """Send every step at once (one transaction on the database backend); the ids in order.

        Nothing is sent when a step cannot be built (a bad argument, a ``job_dispatching``
        receiver that cancels it: ``DispatchCancelled``)."""
        return _send(self.build(), self.calls, backend)


class Group:
    """Jobs that run independently (in parallel), and optionally a callback that runs exactly
    once, after every member finished (``then``)."""

    def __init__(
        self, calls: Sequence[JobBuilder], callback: JobBuilder | None = None, *, only_if_all_succeeded: bool = False
    ) -> None:
        self.calls = _calls(calls, "group()")
        self.callback = callback
        self.only_if_all_succeeded = only_if_all_succeeded

    def then(self, callback: JobBuilder, *, only_if_all_succeeded: bool = False) -> Group:
        """A group whose ``callback`` runs once every member finished, however each ended; with
        ``only_if_all_succeeded``, a member that failed or was cancelled settles the callback
        the same way instead (it never runs)."""
        _calls([callback], "then()")
        return Group(self.calls, callback, only_if_all_succeeded=only_if_all_succeeded)

    def build(self) -> list[Envelope]:
        """The signed envelopes: the members in order, then the callback (naming every member)."""
        envelopes = [call._copy().build() for call in self.calls]
        if self.callback is not None:
            callback = self.callback._copy().depends_on(*(envelope.id for envelope in envelopes))
            envelopes.append(callback.run_if_parent_fails(not self.only_if_all_succeeded).build())
        return envelopes

    def dispatch(self, backend: str | None = None) -> list[str]:
        """Send the members and the callback at once (one transaction on the database backend);
        their ids: the members in order, then the callback's."""
        calls = self.calls if self.callback is None else [*self.calls, self.callback]
        return _send(self.build(), calls, backend)


def chain(*calls: JobBuilder, pass_result: bool = False) -> Chain:
    """``chain(a.prepare(1), b.prepare(), c.prepare())``: run the calls one after the other
    (see :class:`Chain`); ``.dispatch()`` sends them and returns their ids in order."""
    return Chain(calls, pass_result=pass_result)


def group(*calls: JobBuilder) -> Group:
    """``group(a.prepare(1), a.prepare(2)).then(report.prepare())``: run the calls in parallel,
    then the callback exactly once (see :class:`Group`); ``.dispatch()`` returns the ids."""
    return Group(calls)
