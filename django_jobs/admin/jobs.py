"""Admin: the job list and job page (with its attempt history, and the jobs it waits for and
those waiting for it); retry failed or cancelled jobs, cancel pending or waiting ones, abort
pending, waiting or running ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import operations
from ..backends.base import AbortAsked
from ..ids import short
from ..models import FINISHED_STATUSES, Dependency, Job, JobAttempt, JobDashboard, JobStatus, Schedule, Worker

# How much of an error's first line the attempt history and a retry's log message show.
SUMMARY_CHARS = 200
# How much of it the job list's "last error" column shows (the whole first line is its tooltip).
LIST_ERROR_CHARS = 60
# Every time the admin shows, to the second.
SECONDS_FORMAT = "Y-m-d H:i:s"
# How many of a job's parents, and of its children, its page lists (a group's callback has one
# parent per member, and a job may have many children): then how many more there are.
RELATED_SHOWN = 100


def first_line(text: str, limit: int = SUMMARY_CHARS) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def runs_text(attempts: int) -> str:
    """``1 run``, ``3 runs``."""
    return f"{attempts} run{'' if attempts == 1 else 's'}"


def retry_message(job: Job) -> str:
    """The admin log's change message for a retry of ``job``, read before the retry reset it."""
    was = f"was {job.get_status_display().lower()} after {runs_text(job.attempts)}"
    error = first_line(job.last_error)
    return f"Retried ({was}: {error})" if error else f"Retried ({was})"


def cancel_message(job: Job) -> str:
    """The admin log's change message for the cancellation of ``job``, read before it."""
    if job.status == JobStatus.WAITING:
        return "Cancelled (was waiting for the jobs it depends on)"
    if job.attempts == 0:
        return "Cancelled (was pending, never run)"
    return f"Cancelled (was pending a retry after {runs_text(job.attempts)})"


def abort_asked(job: Job) -> AbortAsked | None:
    """The abort ``job`` was asked while it runs, if it was."""
    return operations.running_abort(job.status, job.abort_requested, job.abort_requested_at)


def abort_note(asked: AbortAsked) -> str:
    """``abort requested by admin:boss at 2026-05-01 14:03:09`` (the current time zone)."""
    return f"abort {operations.requested_text(asked, time_text)}"


def duration_text(seconds: float) -> str:
    """``0.042 s``, ``12.5 s``, ``3 min 20 s``, ``2 h 5 min``."""
    if seconds < 10:
        return f"{seconds:.3f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def time_text(value: datetime | None) -> str:
    """``value`` in the current time zone, to the second (``2025-06-01 14:03:09``), or ``—``."""
    if value is None:
        return "—"
    shown: str = formats.date_format(timezone.template_localtime(value), SECONDS_FORMAT)
    return shown


def shown_to_the_second(field: str) -> Callable[[Any, Job], str]:
    """A display method for the ``Job`` datetime ``field``, to the second (the admin's own
    rendering of a read-only datetime drops the seconds)."""

    @admin.display(description=Job._meta.get_field(field).verbose_name, ordering=field)
    def show(model_admin: Any, obj: Job) -> str:
        return time_text(getattr(obj, field))

    shown: Callable[[Any, Job], str] = show
    return shown


def job_duration(job: Job) -> tuple[str, str]:
    """The list's duration cell of ``job`` and its tooltip.

    A finished job: from its dispatch to its end (``finished_at - created_at``: queue waits and
    retries included). A job in progress: since its claim (the claim sets ``updated_at``, and
    nothing else changes it while the job runs), its tooltip saying it runs. A pending job: nothing.
    """
    if job.status in FINISHED_STATUSES and job.finished_at is not None:
        took = duration_text(max((job.finished_at - job.created_at).total_seconds(), 0.0))
        return took, f"{job.get_status_display()} {took} after it was dispatched (waits and retries included)"
    if job.status == JobStatus.IN_PROGRESS:
        running = duration_text(max((timezone.now() - job.updated_at).total_seconds(), 0.0))
        return running, f"running: claimed by a worker {running} ago, at {time_text(job.updated_at)}"
    return "", ""


def badge(job: Job) -> SafeString:
    """``job``'s status, as a coloured badge (status_badges.css)."""
    return format_html('<span class="job-status status-{}">{}</span>', job.status, job.get_status_display())


def one_line(text: str, whole: str | None = None) -> SafeString:
    """``text`` kept to one line of the list, cut with an ellipsis where its column ends; its
    tooltip holds all of it (``whole``, when ``text`` was cut already)."""
    return format_html('<span class="one-line" title="{}">{}</span>', text if whole is None else whole, text)


@dataclass(frozen=True)
class AttemptRow:
    """One line of a job page's attempt history."""

    attempt: JobAttempt

    @property
    def duration(self) -> str:
        started, finished = self.attempt.started_at, self.attempt.finished_at
        if started is None or finished is None:
            return ""
        return duration_text(max((finished - started).total_seconds(), 0.0))

    @property
    def summary(self) -> str:
        return first_line(self.attempt.error)


@dataclass(frozen=True)
class RelatedJob:
    """A parent or child of a job, as its page lists it: linked when its row is here."""

    job_id: str
    row: Job | None
    url: str
    # How the parent ended, as the edge recorded it ("" while it has not finished, or unknown).
    outcome: str = ""


@dataclass(frozen=True)
class Dependencies:
    """A job's parents (in the order it named them) and its children: the first ``RELATED_SHOWN`` of each."""

    parents: list[RelatedJob]
    more_parents: int  # parents not listed
    children: list[RelatedJob]
    more_children: int  # children not listed
    run_if_parent_fails: bool

    def __bool__(self) -> bool:
        return bool(self.parents or self.children)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    # One line per job, on a 1280 px screen with the nav sidebar and the filters open: the name,
    # the queue and the error take the width left and are cut with an ellipsis (change_list.html).
    list_display = (
        "short_id",
        "label",
        "queue_and_backend",
        "status_and_runs",
        "created_on",
        "duration",
        "error_summary",
    )
    list_display_links = ("short_id",)
    list_filter = ("status", "queue", "handler", "backend")
    search_fields = ("id", "name", "handler", "idempotency_key", "last_error")
    date_hierarchy = "created_at"
    actions = ["retry", "cancel", "abort"]
    available = shown_to_the_second("available_at")
    leased = shown_to_the_second("leased_until")
    created = shown_to_the_second("created_at")
    updated = shown_to_the_second("updated_at")
    finished = shown_to_the_second("finished_at")
    # The job's own fields take three lines, and its attempt history follows them
    # (change_form.html): on the screen as a failed job's page opens. The timing is folded.
    fieldsets = (
        (None, {"fields": ("id", ("name", "handler"), ("queue", "backend", "status_badge"))}),
        ("Attempts", {"fields": ("attempts", "max_retries", "last_error_display")}),
        ("Payload", {"fields": ("payload_display", "options", "idempotency_key")}),
        (
            "Timing",
            {
                "classes": ["collapse"],
                "fields": ("priority", "timeout", "available", "leased", "created", "updated", "finished"),
            },
        ),
    )

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Job) -> SafeString:
        return format_html('<span title="{}">{}</span>', obj.pk, short(obj.pk))

    @admin.display(description="job", ordering="name")
    def label(self, obj: Job) -> SafeString:
        return one_line(obj.name or obj.handler)

    @admin.display(description="queue · backend", ordering="queue")
    def queue_and_backend(self, obj: Job) -> SafeString:
        return one_line(f"{obj.queue} · {obj.backend}")

    @admin.display(description="status")
    def status_badge(self, obj: Job) -> SafeString:
        """The status; for a running job asked to abort, who asked and when, below it."""
        asked = abort_asked(obj)
        if asked is None:
            return badge(obj)
        return format_html('{}<div class="job-meta">{}</div>', badge(obj), abort_note(asked))

    @admin.display(description="status · runs", ordering="status")
    def status_and_runs(self, obj: Job) -> SafeString:
        """Its status and its runs (``2/3``: two of the three it may have); for a running job
        asked to abort, "aborting", with who asked and when in its tooltip."""
        allowed = obj.max_retries + 1
        runs = format_html(
            '<span class="job-meta" title="{} of {} allowed">{}/{}</span>',
            runs_text(obj.attempts),
            allowed,
            obj.attempts,
            allowed,
        )
        asked = abort_asked(obj)
        if asked is None:
            return format_html("{} {}", badge(obj), runs)
        return format_html(
            '{} {} <span class="job-meta" title="{}">aborting</span>', badge(obj), runs, abort_note(asked)
        )

    @admin.display(description="created", ordering="created_at")
    def created_on(self, obj: Job) -> SafeString:
        """Its time if it was created today, else its day; to the second in its tooltip."""
        created = timezone.template_localtime(obj.created_at)
        today = timezone.template_localtime(timezone.now()).date()
        shown = formats.date_format(created, "H:i:s" if created.date() == today else "Y-m-d")
        return format_html('<span title="{}">{}</span>', time_text(obj.created_at), shown)

    @admin.display(description="time to finish")
    def duration(self, obj: Job) -> SafeString | str:
        """Its time to finish; a running job's time so far, greyed."""
        text, title = job_duration(obj)
        if not text:
            return "—"
        if obj.status == JobStatus.IN_PROGRESS:
            return format_html('<span class="job-meta" title="{}">{}</span>', title, text)
        return format_html('<span title="{}">{}</span>', title, text)

    @admin.display(description="last error")
    def error_summary(self, obj: Job) -> SafeString | str:
        """The first line of the last error, unless the job completed (a run before failed)."""
        if not obj.last_error or obj.status == JobStatus.COMPLETED:
            return "—"
        whole = first_line(obj.last_error, len(obj.last_error))
        return one_line(first_line(whole, LIST_ERROR_CHARS), whole)

    @admin.display(description="last error")
    def last_error_display(self, obj: Job) -> SafeString:
        return format_html('<pre style="white-space: pre-wrap">{}</pre>', obj.last_error or "—")

    @admin.display(description="payload")
    def payload_display(self, obj: Job) -> SafeString:
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        shown = [
            "status_badge",
            "last_error_display",
            "payload_display",
            "available",
            "leased",
            "created",
            "updated",
            "finished",
        ]
        return [f.name for f in Job._meta.fields] + shown

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # jobs are read-only records; retry and cancel are the ways to change one

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """May retry, cancel and abort jobs: ``django_jobs.change_job``."""
        allowed: bool = request.user.has_perm("django_jobs.change_job")
        return allowed

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("<path:object_id>/retry/", wrap(self.retry_view), name=f"{prefix}_retry"),
            path("<path:object_id>/cancel/", wrap(self.cancel_view), name=f"{prefix}_cancel"),
            path("<path:object_id>/abort/", wrap(self.abort_view), name=f"{prefix}_abort"),
            *super().get_urls(),
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Job | None = None,
    ) -> HttpResponse:
        if obj is not None:
            # One query, from the database the job row came from. Oldest first is insertion
            # order: a retry numbers its attempts from 1 again.
            attempts = JobAttempt.objects.using(obj._state.db).filter(job_id=obj.pk).order_by("id")
            context["attempt_history"] = [AttemptRow(attempt) for attempt in attempts]
            context["dependencies"] = self.dependencies(obj)
            if self.has_operate_permission(request):
                context["job_buttons"] = self._buttons(obj)
        response: HttpResponse = super().render_change_form(request, context, add, change, form_url, obj)
        return response

    def dependencies(self, obj: Job) -> Dependencies:
        """The jobs ``obj`` waits for and the jobs waiting for it, from the edges of its database
        (a broker's job, whose row is a record, shows the parents its message named): the first
        ``RELATED_SHOWN`` of each, whatever their number."""
        edges = Dependency.objects.using(obj._state.db)
        # In the order the child named them: the order its edges were inserted.
        mine = edges.filter(child=obj.pk).order_by("id").values_list("parent", "outcome")
        parents: list[tuple[str, str | None]] = list(mine[:RELATED_SHOWN])
        parent_count = mine.count() if len(parents) == RELATED_SHOWN else len(parents)
        named = obj.options.get("parents") if isinstance(obj.options, dict) else None
        if not parents and isinstance(named, list):
            parents = [(p, None) for p in named if isinstance(p, str)]
            parent_count = len(parents)
            parents = parents[:RELATED_SHOWN]
        children = edges.filter(parent=obj.pk).order_by("created_at", "child").values_list("child", flat=True)
        shown = list(children[:RELATED_SHOWN])
        child_count = children.count() if len(shown) == RELATED_SHOWN else len(shown)
        ids = [*(parent for parent, _ in parents), *shown]
        rows = Job.objects.using(obj._state.db).only("id", "name", "handler", "status").in_bulk(ids)

        def related(job_id: str, outcome: str | None = None) -> RelatedJob:
            row = rows.get(job_id)
            return RelatedJob(job_id, row, self._url("change", row) if row is not None else "", outcome or "")

        return Dependencies(
            [related(parent, outcome) for parent, outcome in parents],
            parent_count - len(parents),
            [related(c) for c in shown],
            child_count - len(shown),
            bool(obj.options.get("run_if_parent_fails")) if isinstance(obj.options, dict) else False,
        )

    def _buttons(self, obj: Job) -> list[dict[str, str]]:
        """The job page's Retry, Cancel or Abort button, as the job's status allows; for a
        running job asked to abort, that state (no URL: not a button)."""
        if obj.status in operations.RETRYABLE:
            return [{"name": "retry", "label": "Retry", "url": self._url("retry", obj)}]
        if obj.status in operations.NOT_STARTED:
            return [{"name": "cancel", "label": "Cancel", "url": self._url("cancel", obj)}]
        asked = abort_asked(obj)
        if asked is not None:
            return [{"name": "aborting", "label": "Abort requested", "url": "", "title": abort_note(asked)}]
        if obj.status == JobStatus.IN_PROGRESS:
            return [{"name": "abort", "label": "Abort", "url": self._url("abort", obj)}]
        return []

    def _url(self, view: str, obj: Job | None = None) -> str:
        """The URL of this admin's ``view`` (``changelist``, ``change``, ``retry``, ``cancel``, ``abort``)."""
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"
        url: str = reverse(name, args=[] if obj is None else [quote(obj.pk)])
        return url

    # -- retry ----------------------------------------------------------------------------------

    @admin.action(description="Retry selected failed or cancelled jobs", permissions=["operate"])
    def retry(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        """Requeue the failed and cancelled jobs selected; each retry is logged in the job's admin history."""
        outcome = operations.retry_jobs(queryset)
        for job in outcome.jobs:
            self.log_change(request, job, retry_message(job))
        for error in outcome.errors:
            self.message_user(request, error, messages.ERROR)
        for note in outcome.notes:
            self.message_user(request, note, messages.INFO)
        skipped = queryset.count() - outcome.retried - len(outcome.errors)
        level = messages.SUCCESS if outcome.retried else messages.WARNING
        self.message_user(request, f"Requeued {outcome.retried} job(s).", level)
        if skipped > 0:
            self.message_user(
                request,
                f"{skipped} selected job(s) were not failed or cancelled and were left alone.",
                messages.WARNING,
            )

    def retry_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The job page's Retry button (POST)."""
        return self._button(request, object_id, self.retry)

    # -- cancel ---------------------------------------------------------------------------------

    @admin.action(description="Cancel selected pending or waiting jobs", permissions=["operate"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        """Cancel the pending (or waiting) jobs selected (a job claimed meanwhile runs on); each
        is logged. The jobs waiting for them are cancelled too, unless ``run_if_parent_fails``."""
        user = request.user.get_username()
        outcome = operations.cancel_jobs(queryset, f"Cancelled by {user} in the admin", worker=f"admin:{user}")
        for job in outcome.jobs:
            self.log_change(request, job, cancel_message(job))
        if not outcome.jobs:
            self.message_user(
                request,
                "No job was cancelled: only pending or waiting jobs can be, and a job queued on a broker "
                "(Redis, beanstalkd, Service Bus) has no row here until it fails.",
                messages.ERROR,
            )
            return
        self.message_user(request, f"Cancelled {len(outcome.jobs)} job(s).", messages.SUCCESS)
        skipped = queryset.count() - len(outcome.jobs)
        if skipped > 0:
            self.message_user(
                request, f"{skipped} selected job(s) were not pending or waiting and were left alone.", messages.WARNING
            )

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The job page's Cancel button (POST)."""
        return self._button(request, object_id, self.cancel)

    # -- abort ----------------------------------------------------------------------------------

    @admin.action(description="Abort selected jobs", permissions=["operate"])
    def abort(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        """Cancel the pending jobs selected and ask the running ones to abort (their workers end
        them ``cancelled``); those asked before and finished ones are left alone. Each
        cancellation and request is logged."""
        who = f"admin:{request.user.get_username()}"[: operations.MAX_REQUESTED_BY]
        selected = {str(job.pk): job for job in queryset}
        outcome = operations.abort_jobs(list(selected), who)
        for pk in outcome.cancelled:
            self.log_change(request, selected[pk], f"Aborted: {cancel_message(selected[pk])}")
        for pk in outcome.asked:
            self.log_change(request, selected[pk], "Asked to abort while running")
        if not outcome.stopped and not outcome.already:
            self.message_user(
                request, "No job was aborted: only pending, waiting or running jobs can be.", messages.ERROR
            )
            return
        if outcome.cancelled:
            self.message_user(request, f"Cancelled {len(outcome.cancelled)} job(s) before they ran.", messages.SUCCESS)
        if outcome.asked:
            self.message_user(
                request,
                f"Asked {len(outcome.asked)} running job(s) to abort: each ends cancelled, its worker stops it "
                f"within about {operations.abort_within()} s.",
                messages.SUCCESS,
            )
        if outcome.already:
            asked = "; ".join(
                f"{pk[:8]} {operations.requested_text(a, time_text)}" for pk, a in outcome.already.items()
            )
            self.message_user(request, f"Abort already requested, left as it is: {asked}.", messages.INFO)
        if outcome.finished:
            self.message_user(
                request,
                f"{len(outcome.finished)} selected job(s) had already finished and were left alone.",
                messages.WARNING,
            )

    def abort_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The job page's Abort button (POST)."""
        return self._button(request, object_id, self.abort)

    def _button(
        self, request: HttpRequest, object_id: str, action: Callable[[HttpRequest, QuerySet[Job]], None]
    ) -> HttpResponse:
        """Run ``action`` on one job for a POST of a user allowed to, then show the job again
        (or the list, when the job's row is gone: a broker's job re-dispatched by a retry)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_operate_permission(request):
            raise PermissionDenied
        job = self.get_object(request, unquote(object_id))
        if job is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        jobs = self.get_queryset(request).filter(pk=job.pk)
        action(request, jobs)
        return HttpResponseRedirect(self._url("change", job) if jobs.exists() else self._url("changelist"))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Links above the list to the dashboard, the workers panel and the schedules, for whoever may see them.
        links: dict[str, Any] = {"dashboard_url": JobDashboard, "workers_url": Worker, "schedules_url": Schedule}
        extra = {
            key: reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
            for key, model in links.items()
            if self.admin_site.get_model_admin(model).has_view_permission(request)
        }
        return super().changelist_view(request, {**extra, **(extra_context or {})})
