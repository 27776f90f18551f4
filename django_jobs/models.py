"""The ``Job`` table (the database backend's queue, and the audit trail of every failure) and
``JobAttempt``, one row per finished attempt (the attempt history)."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from .envelope import Envelope
from .jsoncolumns import FloatKeepingEncoder


class JobStatus(models.TextChoices):
    # Held until every parent job finished (``depends_on``): not claimable, not a run.
    WAITING = "waiting", "Waiting for parents"
    PENDING = "pending", "Pending"
    IN_PROGRESS = "in_progress", "In progress"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


# Statuses a job never leaves by itself: it ran (completed, failed) or was stopped (cancelled).
FINISHED_STATUSES = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


# The columns that hold a job's own message fields; the others are its state in the table.
ENVELOPE_COLUMNS = (
    "queue", "handler", "payload", "options", "signature", "name", "max_retries", "priority", "timeout",
    "idempotency_key",
)  # fmt: skip


def envelope_columns(envelope: Envelope) -> dict[str, Any]:
    """A ``Job`` row's message columns, from ``envelope`` (its id aside)."""
    return {column: getattr(envelope, column) for column in ENVELOPE_COLUMNS}


def envelope_of(row: Job) -> Envelope:
    """The envelope a ``Job`` row describes, as first dispatched (attempts 0, available now)."""
    columns = {column: getattr(row, column) for column in ENVELOPE_COLUMNS}
    return Envelope(id=row.id, **{**columns, "options": row.options or {}})


class ClaimedAhead(models.IntegerChoices):
    """How a row was claimed (``Job.claimed_ahead``): a worker that claims a batch holds the
    jobs after the first ahead of their runs, and a lost claim of one that never started is
    not a run."""

    NO = 0, "No"  # claimed alone and run at once, or not claimed: a lost lease is a lost run
    YES = 1, "Yes"  # claimed in a batch, not started: a lost lease is handed back, not counted
    LOST = 2, "After a lost claim"  # a claim of it was lost (its worker died): its start is recorded first


class Job(models.Model):
    id = models.CharField(primary_key=True, max_length=64, editable=False)
    queue = models.CharField(max_length=100)
    handler = models.CharField(max_length=255)
    # Written so that a float comes back a float (PostgreSQL's jsonb would turn 1e20 into an int).
    payload = models.JSONField(default=dict, blank=True, encoder=FloatKeepingEncoder)
    # Per-job behaviour that travels with the message (backoff, retry_on, single_instance).
    options = models.JSONField(default=dict, blank=True, encoder=FloatKeepingEncoder)
    signature = models.CharField(max_length=128, blank=True)
    name = models.CharField(max_length=255, blank=True)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0, help_text="Runs completed (success, failure or lost lease).")
    max_retries = models.PositiveIntegerField(default=0)
    priority = models.IntegerField(default=0, help_text="Higher runs sooner.")
    available_at = models.DateTimeField(default=timezone.now)
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds per attempt.")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    owner_token = models.CharField(max_length=64, null=True, blank=True)
    leased_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    backend = models.CharField(max_length=100, default="default", help_text="Backend the job was dispatched to.")
    # What the job returned, as JSON: kept only for jobs that ask for it (``keep_result``).
    result = models.JSONField(null=True, blank=True, encoder=FloatKeepingEncoder)
    claimed_ahead = models.PositiveSmallIntegerField(
        choices=ClaimedAhead.choices,
        default=ClaimedAhead.NO,
        help_text="Claimed in a batch ahead of its run: a lost claim that never started is not counted as a run.",
    )
    # Who asked to abort the running job (``admin:boss``, ``command``, ``api``); NULL: nobody.
    # Its worker's heartbeat reads it and stops the job.
    abort_requested = models.CharField(max_length=150, null=True, blank=True)
    # When the abort was first asked (NULL: nobody asked, or a release before this column asked).
    abort_requested_at = models.DateTimeField(null=True, blank=True)
    # Some job waits for this one (a ``Dependency`` names it as parent): its ack takes the
    # transactional path that resolves those edges. Set, under this row's lock, when the first
    # dependent is attached; never cleared.
    # (A database default too: a process of the previous release inserts rows without it.)
    has_dependents = models.BooleanField(default=False, db_default=False)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # The claim query reads only this partial index, so a table holding millions of
            # completed or failed rows claims as fast as an empty one.
            models.Index(
                fields=["queue", "-priority", "available_at", "id"],
                condition=Q(status="pending"),
                name="django_jobs_claim_idx",
            ),
            # The reaper's scan of expired leases.
            models.Index(fields=["leased_until"], condition=Q(status="in_progress"), name="django_jobs_lease_idx"),
            # Admin filters, jobs_stats and jobs_purge.
            models.Index(fields=["status", "queue"], name="django_jobs_status_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.name or self.handler} [{self.status}] {self.id}"


class Dependency(models.Model):
    """An edge of the database backend: ``child`` waits for ``parent`` to finish.

    ``outcome`` is empty while the parent has not finished, then how it ended (``completed``,
    ``failed`` or ``cancelled``); it is written in the transaction that settles the parent. Ids
    are plain columns, not foreign keys: finished jobs may be purged, and their edges with them.
    """

    parent = models.CharField(max_length=64)  # indexed first by the unique (parent, child)
    child = models.CharField(max_length=64)
    outcome = models.CharField(max_length=16, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["parent", "child"], name="django_jobs_dependency_uniq")]
        indexes = [
            # A child's edges, and its open ones (is it still waiting for a parent?).
            models.Index(fields=["child", "outcome"], name="django_jobs_dep_child_idx"),
            # The reaper pass's sweep of edges left open: only those of unfinished parents.
            models.Index(fields=["parent"], condition=Q(outcome__isnull=True), name="django_jobs_dep_open_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.child} waits for {self.parent} ({self.outcome or 'open'})"


class AttemptOutcome(StrEnum):
    """How one attempt ended (a plain ``StrEnum``: the worker compares and stores its values)."""

    COMPLETED = "completed"
    RETRYING = "retrying"
    FAILED = "failed"
    LOST = "lost"
    CANCELLED = "cancelled"


ATTEMPT_OUTCOME_CHOICES = [
    (AttemptOutcome.COMPLETED.value, "Completed"),
    (AttemptOutcome.RETRYING.value, "Retrying"),
    (AttemptOutcome.FAILED.value, "Failed"),
    (AttemptOutcome.LOST.value, "Lost (worker crashed or stalled)"),
    (AttemptOutcome.CANCELLED.value, "Cancelled"),
]


class JobAttempt(models.Model):
    """One finished attempt of a job: who ran it, when, and how it ended.

    Failed and lost attempts are always recorded; a completed one only for jobs that keep their
    result (``keep_result``), so a successful job costs no extra write. The newest
    ``JOBS["HISTORY_LIMIT"]`` attempts of each job are kept. The job row may not exist (yet): a
    broker's job has a ``Job`` row only once it failed for good or kept a result, so the key is
    not a database constraint.
    """

    # DO_NOTHING: an admin retry of a broker's job replaces its row and keeps its history;
    # jobs_purge deletes the history of the jobs it purges.
    job = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="history", db_index=True
    )
    attempt = models.PositiveIntegerField(help_text="1-based run number.")
    outcome = models.CharField(max_length=16, choices=ATTEMPT_OUTCOME_CHOICES)
    worker_id = models.CharField(max_length=100, blank=True, help_text="host:pid of the worker.")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(default=timezone.now)
    error_class = models.CharField(max_length=255, blank=True, help_text="Dotted path of the exception.")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["job_id", "attempt", "id"]
        indexes = [models.Index(fields=["finished_at"], name="django_jobs_attempt_fin_idx")]

    def __str__(self) -> str:
        return f"{self.job_id} attempt {self.attempt}: {self.outcome}"


class WorkerQuerySet(models.QuerySet["Worker"]):
    def alive(self, now: datetime | None = None) -> WorkerQuerySet:
        """Workers that have not stopped and were seen within ``Worker.DEAD_AFTER``."""
        now = now or timezone.now()
        alive: WorkerQuerySet = self.filter(stopped_at__isnull=True, last_seen__gte=now - Worker.DEAD_AFTER)
        return alive


class Worker(models.Model):
    """One worker process, as it last reported itself (the admin's workers panel, ``jobs_health``).

    Each worker process writes its row when it starts, every ``Worker.BEAT`` while it runs (from
    its heartbeat thread: no statement per job), and when it stops. A row not written for
    ``Worker.DEAD_AFTER`` belongs to a process that died without a word (SIGKILL, a lost host).
    """

    BEAT = timedelta(seconds=5)
    DEAD_AFTER = timedelta(seconds=30)

    id = models.CharField(primary_key=True, max_length=100, help_text="host:pid:random, unique per process.")
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    backend = models.CharField(max_length=100)
    queues = models.JSONField(default=list)
    started_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now, db_index=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    current_job = models.CharField(max_length=64, blank=True, help_text="Id of the job running now.")
    current_job_name = models.CharField(max_length=255, blank=True, help_text="Its name, or else its handler.")
    current_job_started = models.DateTimeField(null=True, blank=True)
    processed = models.PositiveBigIntegerField(default=0, help_text="Deliveries since the process started.")

    objects = WorkerQuerySet.as_manager()

    class Meta:
        ordering = ["-last_seen"]

    def __str__(self) -> str:
        return f"{self.hostname}:{self.pid}"

    def state(self, now: datetime | None = None) -> str:
        """``running``, ``stopped`` or ``dead`` (not seen for ``DEAD_AFTER``)."""
        if self.stopped_at is not None:
            return "stopped"
        return "running" if self.last_seen >= (now or timezone.now()) - self.DEAD_AFTER else "dead"


class Throughput(models.Model):
    """Deliveries per minute of one worker process on one backend and queue, by how they ended.

    Each worker adds its counts every ``Worker.BEAT`` (no statement per job) to its own row of
    the minute, so no two writers share a row. The dashboard sums them: throughput and failure
    rates for every backend, brokers included, whose finished jobs leave no row of their own.
    """

    minute = models.DateTimeField()
    worker = models.CharField(max_length=100, help_text="Worker.id of the process that counted.")
    backend = models.CharField(max_length=100)
    queue = models.CharField(max_length=100)
    completed = models.PositiveIntegerField(default=0)
    retried = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0, help_text="Failed for good (no retry left).")
    rejected = models.PositiveIntegerField(default=0, help_text="Never run: tampered, undecodable or unknown handler.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["minute", "worker", "backend", "queue"], name="django_jobs_throughput_uniq")
        ]
        indexes = [models.Index(fields=["minute"], name="django_jobs_throughput_min_idx")]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.backend}/{self.queue} ({self.worker})"


class Schedule(models.Model):
    """One entry of ``JOBS["SCHEDULE"]``, as the schedulers last synced it from the settings.

    The settings are the source of truth: each scheduler writes the entries it reads at start,
    and disables (never deletes) the rows of entries no longer in the settings, so their ticks
    stay in the history. ``next_run``, ``last_run`` and ``last_pass_at`` are for people (the
    admin); which ticks are due is worked out from the entry and its ``ScheduleTick`` rows.
    """

    name = models.CharField(primary_key=True, max_length=200)
    definition = models.JSONField(default=dict, help_text="The entry as written in JOBS['SCHEDULE'].")
    description = models.CharField(max_length=255, blank=True, help_text="The schedule in words.")
    time_zone = models.CharField(max_length=64, blank=True, help_text="The zone its times are read in.")
    enabled = models.BooleanField(default=True)
    in_settings = models.BooleanField(default=True, help_text="False once the entry left JOBS['SCHEDULE'].")
    next_run = models.DateTimeField(null=True, blank=True)
    last_run = models.DateTimeField(null=True, blank=True, help_text="The latest tick dispatched.")
    last_job_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_pass_at = models.DateTimeField(
        null=True, blank=True, help_text="When a scheduler with this entry in its settings last passed (every 15 s)."
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return str(self.name)


class ScheduleTick(models.Model):
    """One dispatch of a schedule entry: the tick it was due at and the job it became.

    The unique (schedule, tick) pair is what makes a tick run exactly once across any number of
    schedulers: each claims a tick by inserting its row, in the transaction that dispatches it.
    ``dispatched_at`` stays empty until the job reached its backend (a broker's push happens after
    the commit), so a tick claimed by a scheduler that crashed before the push is sent again;
    ``abandoned_at`` is set instead when its entry was disabled or removed first: it is never sent.
    """

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="ticks")
    tick = models.DateTimeField(help_text="When the entry was due (for a manual run: when it was asked).")
    job_id = models.CharField(max_length=64)
    manual = models.BooleanField(default=False, help_text="Run now from the admin, not a tick of the schedule.")
    claimed_at = models.DateTimeField(default=timezone.now)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    abandoned_at = models.DateTimeField(
        null=True, blank=True, help_text="Given up unsent: its entry was disabled or removed before it was sent."
    )

    class Meta:
        ordering = ["-tick"]
        constraints = [models.UniqueConstraint(fields=["schedule", "tick"], name="django_jobs_schedule_tick_uniq")]
        indexes = [
            models.Index(
                fields=["claimed_at"], condition=Q(dispatched_at__isnull=True), name="django_jobs_tick_pending_idx"
            )
        ]

    def __str__(self) -> str:
        return f"{self.schedule_id} @ {self.tick:%Y-%m-%d %H:%M:%S%z}"


class JobDashboard(Job):
    """No table of its own: puts the jobs dashboard on the admin index, beside Jobs and Workers."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"


# -- rate and concurrency limits (the database backend's own state; see backends/db_limits.py) --

LIMIT_KEY_LENGTH = 200  # limits.KEY_MAX_LENGTH


class LimitState(models.Model):
    """One row per limit key: locked to serialise the grants of that limit across workers, and
    holding its caps as a worker last applied them (the room a release sees)."""

    key = models.CharField(primary_key=True, max_length=LIMIT_KEY_LENGTH)
    concurrency = models.PositiveIntegerField(null=True, blank=True)
    rate_count = models.PositiveIntegerField(null=True, blank=True)
    rate_period = models.FloatField(null=True, blank=True, help_text="Seconds.")
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return str(self.key)


class LimitSlot(models.Model):
    """A concurrency slot held by a running job. It counts only while that job's row is
    ``in_progress`` under the same owner token: a crashed worker's slot frees when its lease is
    reaped, and a leftover row is merely deleted later."""

    key = models.CharField(max_length=LIMIT_KEY_LENGTH)
    job_id = models.CharField(max_length=64)
    owner_token = models.CharField(max_length=64)
    taken_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["key", "job_id"], name="django_jobs_limit_slot_uniq")]
        indexes = [models.Index(fields=["job_id"], name="django_jobs_lslot_job_idx")]


class LimitWaiter(models.Model):
    """A job parked by a full concurrency limit: a release of that limit wakes the oldest."""

    key = models.CharField(max_length=LIMIT_KEY_LENGTH)
    job_id = models.CharField(max_length=64)
    parked_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["key", "job_id"], name="django_jobs_limit_waiter_uniq")]
        indexes = [
            models.Index(fields=["key", "parked_at"], name="django_jobs_lwait_idx"),
            models.Index(fields=["job_id"], name="django_jobs_lwait_job_idx"),
        ]


class LimitStart(models.Model):
    """A start under a rate limit, at ``at``: granted, or ``reserved`` for ``job_id``, which
    starts at that time without asking again. Rows older than the limit's period are deleted
    as the limit is used."""

    key = models.CharField(max_length=LIMIT_KEY_LENGTH)
    at = models.DateTimeField()
    job_id = models.CharField(max_length=64)
    reserved = models.BooleanField(default=False)

    class Meta:
        indexes = [
            models.Index(fields=["key", "at"], name="django_jobs_lstart_idx"),
            models.Index(fields=["job_id"], name="django_jobs_lstart_job_idx"),
        ]
