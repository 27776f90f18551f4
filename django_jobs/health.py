"""Health of the job system, for container health checks (``manage.py jobs_health``).

For each backend: can it be reached, does any queue hold a ready job older than ``max_age``
(:meth:`~django_jobs.backends.base.QueueBackend.oldest_ready_age`), does a live worker serve
each queue (the ``Worker`` rows every ``jobs_work`` process keeps), and would a restart of its
server lose the queued jobs (:meth:`~django_jobs.backends.base.QueueBackend.persistence_warning`,
a warning unless ``strict``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

from django.utils import timezone

from .backends import get_backend, persistence_warning
from .backends.base import QueueBackend

Status = Literal["ok", "problem", "warning"]


@dataclass(frozen=True, slots=True)
class Check:
    """One thing looked at: ``what`` (reachable, ready-age, workers, persistence), where, and how it is."""

    what: str
    backend: str
    queue: str | None
    status: Status
    detail: str

    @property
    def where(self) -> str:
        return self.backend if self.queue is None else f"{self.backend}/{self.queue}"

    def line(self) -> str:
        return f"{self.status:<8} {self.where}: {self.detail}"


@dataclass(slots=True)
class HealthReport:
    """The checks made, in order. Healthy when none found a problem (and, when ``strict``, none
    a warning either)."""

    strict: bool = False
    checks: list[Check] = field(default_factory=list)

    def add(self, what: str, backend: str, queue: str | None, status: Status, detail: str) -> None:
        self.checks.append(Check(what, backend, queue, status, detail))

    def failing(self) -> list[Check]:
        """The checks that make the system unhealthy."""
        bad = ("problem", "warning") if self.strict else ("problem",)
        return [check for check in self.checks if check.status in bad]

    @property
    def healthy(self) -> bool:
        return not self.failing()

    def summary(self) -> str:
        counts = {status: sum(c.status == status for c in self.checks) for status in ("ok", "problem", "warning")}
        tally = f"{counts['ok']} ok, {counts['problem']} problem(s), {counts['warning']} warning(s)"
        if self.healthy:
            return f"healthy: {tally}"
        failing = "; ".join(f"{c.where}: {c.detail}" for c in self.failing())
        return f"unhealthy ({tally}{', --strict' if self.strict else ''}): {failing}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "strict": self.strict,
            "summary": self.summary(),
            "checks": [asdict(check) for check in self.checks],
        }


def check(
    backends: Iterable[str],
    queues: list[str],
    *,
    max_age: float | None,
    workers: bool = True,
    strict: bool = False,
    now: datetime | None = None,
) -> HealthReport:
    """Look at each of ``backends`` (names) and its ``queues``; never raises for a backend's
    error (it is the check's finding). ``max_age=None`` skips the ready-age check and
    ``workers=False`` the live-worker check."""
    report = HealthReport(strict=strict)
    now = now or timezone.now()
    for name in backends:
        backend = get_backend(name)
        if not backend.persistent:
            report.add("reachable", name, None, "ok", "runs each job at dispatch: no queue to watch")
            continue
        if not _queues_look_fine(report, backend, queues, max_age):
            continue  # unreachable: nothing more can be learned from it
        if workers:
            _served(report, name, queues, now)
        warning = persistence_warning(backend)
        if warning is not None:
            report.add("persistence", name, None, "warning", warning)
    return report


def _queues_look_fine(report: HealthReport, backend: QueueBackend, queues: list[str], max_age: float | None) -> bool:
    """The ready age of each queue; ``False`` (one problem naming the backend) when the backend
    cannot be reached."""
    ages: dict[str, float | None] = {}
    try:
        for queue in queues:
            backend.stats(queue)  # every backend's stats talk to its server: the reachability probe
            if max_age is not None:
                ages[queue] = backend.oldest_ready_age(queue)
    except Exception as exc:  # noqa: BLE001 - whatever the client raises is the finding
        report.add("reachable", backend.name, None, "problem", f"unreachable: {_one_line(exc)}")
        return False
    report.add("reachable", backend.name, None, "ok", "reachable")
    for queue, age in ages.items():
        if age is None or max_age is None:
            report.add("ready-age", backend.name, queue, "ok", "no ready job waiting (or its age is unknown)")
        elif age > max_age:
            detail = f"the oldest ready job has waited {age:.0f}s, more than --max-age {max_age:g}s"
            report.add("ready-age", backend.name, queue, "problem", detail)
        else:
            report.add("ready-age", backend.name, queue, "ok", f"the oldest ready job has waited {age:.0f}s")
    return True


def _served(report: HealthReport, backend: str, queues: list[str], now: datetime) -> None:
    """A live ``Worker`` row of ``backend`` lists each queue (else the latest row, if any, says
    when a worker last served it)."""
    from .models import Worker  # the models load after the app registry

    try:
        rows = list(Worker.objects.filter(backend=backend))
    except Exception as exc:  # noqa: BLE001 - the worker table's database is down: a finding
        for queue in queues:
            report.add("workers", backend, queue, "problem", f"cannot read the worker table: {_one_line(exc)}")
        return
    for queue in queues:
        serving = [row for row in rows if isinstance(row.queues, list) and queue in row.queues]
        alive = [row for row in serving if row.state(now) == "running"]
        if alive:
            report.add("workers", backend, queue, "ok", f"{len(alive)} live worker(s)")
            continue
        last = max(serving, key=lambda row: row.last_seen, default=None)
        detail = "no live worker serves it"
        if last is not None:
            ended = "stopped" if last.stopped_at is not None else "was last seen"
            detail += f" ({last} {ended} {(now - (last.stopped_at or last.last_seen)).total_seconds():.0f}s ago)"
        report.add("workers", backend, queue, "problem", detail)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
