"""The schedules: each entry of ``JOBS["SCHEDULE"]`` as the schedulers last synced it, its
latest ticks, and a "run now" action; a warning when no scheduler passes. Read-only: the
settings are the source of truth."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count, Max, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import Schedule, ScheduleTick
from .jobs import time_text
from .workers import job_cell, known_jobs, two_lines

NOTE = (
    'Schedules are defined in the settings (JOBS["SCHEDULE"]) and cannot be changed here: '
    "each scheduler writes them at its start. An entry taken out of the settings stays, disabled, "
    "with its history."
)
# How many of a schedule's latest ticks its page lists.
TICKS_SHOWN = 25
# A schedule's state and the job status badge whose colour it wears (status_badges.css).
BADGES = {"enabled": "completed", "disabled": "cancelled", "removed from settings": "in_progress"}
# A schedule no scheduler has passed over for this long is not dispatched: the list warns. Four
# times the interval at which schedulers record their passes (``scheduler.RECORD_PASS``).
UNATTENDED_AFTER = timedelta(minutes=1)


def state(schedule: Schedule) -> str:
    """``enabled``, ``disabled`` or ``removed from settings``."""
    if not schedule.in_settings:
        return "removed from settings"
    return "enabled" if schedule.enabled else "disabled"


def unattended(last_pass: datetime | None, now: datetime) -> bool:
    """No scheduler has passed for ``UNATTENDED_AFTER`` (none ever did, for ``None``)."""
    return last_pass is None or last_pass < now - UNATTENDED_AFTER


def overdue(schedule: Schedule, now: datetime) -> str:
    """What to say of a next run that is past: ``overdue: no scheduler running`` when no
    scheduler with the entry in its settings passes, else ``overdue`` (its dispatch fails);
    nothing for a next run to come."""
    if schedule.next_run is None or schedule.next_run > now:
        return ""
    return "overdue: no scheduler running" if unattended(schedule.last_pass_at, now) else "overdue"


def scheduler_warning(now: datetime) -> SafeString | str:
    """The warning above the list when schedules are enabled and no scheduler has passed for
    ``UNATTENDED_AFTER``, else nothing (one query)."""
    seen = Schedule.objects.aggregate(last=Max("last_pass_at"), enabled=Count("pk", filter=Q(enabled=True)))
    if not seen["enabled"] or not unattended(seen["last"], now):
        return ""
    last = f"the last pass: {time_text(seen['last'])}" if seen["last"] else "none recorded"
    return format_html(
        "No scheduler has passed for over a minute ({}): enabled schedules are not dispatched. "
        "Run <code>manage.py jobs_schedule</code>, or <code>jobs_work --with-scheduler</code>.",
        last,
    )


def ran_message(job_ids: list[str]) -> str:
    """The message after a "run now": which jobs were dispatched."""
    return f"Ran {len(job_ids)} schedule(s) now: job(s) {', '.join(job_ids)}."


@dataclass(frozen=True)
class TickRow:
    """One line of a schedule page's tick table."""

    tick: ScheduleTick
    job_known: bool

    @property
    def kind(self) -> str:
        return "manual" if self.tick.manual else "scheduled"

    @property
    def job(self) -> SafeString | str:
        return job_cell(self.tick.job_id, self.job_known)

    @property
    def times(self) -> dict[str, str]:
        """The tick, its claim and its dispatch (or when it was abandoned unsent), to the second."""
        tick = self.tick
        if tick.dispatched_at:
            dispatched = time_text(tick.dispatched_at)
        elif tick.abandoned_at:
            dispatched = f"never (abandoned {time_text(tick.abandoned_at)})"
        else:
            dispatched = "not yet"
        return {"tick": time_text(tick.tick), "claimed": time_text(tick.claimed_at), "dispatched": dispatched}


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    """Read-only (no add, change or delete); users who may change schedules may run one now."""

    # The schedule in words and its zone show under the name, times on two lines: the list fits a
    # 1280 px screen with the nav sidebar and the filters open.
    list_display = ("name_and_schedule", "next", "last", "last_job", "state_badge", "dispatched")
    list_display_links = ("name_and_schedule",)
    list_filter = ("enabled", "in_settings")
    search_fields = ("name",)
    actions = ["run_now"]
    list_per_page = 50
    fieldsets = (
        (None, {"fields": ("name", "description", "time_zone", "state_badge")}),
        ("Runs", {"fields": ("next_run_display", "last_run_display", "last_job", "dispatched", "last_pass")}),
        ("Definition", {"fields": ("definition_display", "created", "updated")}),
    )
    readonly_fields = (
        "name",
        "description",
        "time_zone",
        "state_badge",
        "next_run_display",
        "last_run_display",
        "last_job",
        "dispatched",
        "last_pass",
        "definition_display",
        "created",
        "updated",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        """Each row with its count of dispatched ticks (in the same query)."""
        queryset: QuerySet[Schedule] = super().get_queryset(request)
        return queryset.annotate(dispatched_ticks=Count("ticks", filter=Q(ticks__dispatched_at__isnull=False)))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the settings are the source of truth

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a scheduler would write the row again; its ticks are the history

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """May run schedules now: ``django_jobs.change_schedule``."""
        allowed: bool = request.user.has_perm("django_jobs.change_schedule")
        return allowed

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        shown = {"title": "Schedules", "schedules_note": NOTE, "scheduler_warning": scheduler_warning(timezone.now())}
        return super().changelist_view(request, {**shown, **(extra_context or {})})

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """The page's schedules, each told whether its last job has a page (one query for all)
        and whether its next run is overdue."""
        changelist: ChangeList = super().get_changelist_instance(request)
        schedules = list(changelist.result_list)  # evaluated once: the template reads the same rows
        known = known_jobs(schedule.last_job_id for schedule in schedules)
        now = timezone.now()
        for schedule in schedules:
            schedule.job_known = schedule.last_job_id in known
            schedule.overdue = overdue(schedule, now)
        return changelist

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Schedule | None = None,
    ) -> HttpResponse:
        if obj is not None:
            # One query for the ticks, from the database the schedule row came from, and one for
            # which of their jobs have a page.
            ticks = list(ScheduleTick.objects.using(obj._state.db).filter(schedule_id=obj.pk)[:TICKS_SHOWN])
            known = known_jobs([tick.job_id for tick in ticks] + [obj.last_job_id])
            obj.job_known = obj.last_job_id in known
            context["tick_rows"] = [TickRow(tick, tick.job_id in known) for tick in ticks]
            context["ticks_shown"] = TICKS_SHOWN
        response: HttpResponse = super().render_change_form(request, context, add, change, form_url, obj)
        return response

    @admin.display(description="schedule", ordering="name")
    def name_and_schedule(self, obj: Schedule) -> SafeString:
        """Its name over the schedule in words and its zone (unless the words name it already)."""
        words, zone = str(obj.description) or "—", str(obj.time_zone)
        return two_lines(obj.name, words if not zone or zone in words else f"{words} · {zone}")

    @admin.display(description="next run", ordering="next_run")
    def next(self, obj: Schedule) -> SafeString | str:
        """Its next run; below it, whether it is overdue."""
        shown = self._two_line_time(obj.next_run)
        late = getattr(obj, "overdue", "")
        return format_html('{}<div class="overdue">{}</div>', shown, late) if late else shown

    @admin.display(description="last run", ordering="last_run")
    def last(self, obj: Schedule) -> SafeString | str:
        return self._two_line_time(obj.last_run)

    @staticmethod
    def _two_line_time(value: Any) -> SafeString | str:
        """A time to the second, its date over its time (the list stays narrow)."""
        if value is None:
            return "—"
        day, _, clock = time_text(value).partition(" ")
        return two_lines(day, clock)

    @admin.display(description="next run")
    def next_run_display(self, obj: Schedule) -> str:
        late = overdue(obj, timezone.now())
        return f"{time_text(obj.next_run)} ({late})" if late else time_text(obj.next_run)

    @admin.display(description="last scheduler pass")
    def last_pass(self, obj: Schedule) -> str:
        return time_text(obj.last_pass_at)

    @admin.display(description="last run")
    def last_run_display(self, obj: Schedule) -> str:
        return time_text(obj.last_run)

    @admin.display(description="created")
    def created(self, obj: Schedule) -> str:
        return time_text(obj.created_at)

    @admin.display(description="updated")
    def updated(self, obj: Schedule) -> str:
        return time_text(obj.updated_at)

    @admin.display(description="last job")
    def last_job(self, obj: Schedule) -> SafeString | str:
        return job_cell(obj.last_job_id, getattr(obj, "job_known", False))

    @admin.display(description="state", ordering="enabled")
    def state_badge(self, obj: Schedule) -> SafeString:
        shown = state(obj)
        return format_html('<span class="job-status status-{}">{}</span>', BADGES[shown], shown)

    @admin.display(description="ticks", ordering="dispatched_ticks")
    def dispatched(self, obj: Schedule) -> int:
        count: int = getattr(obj, "dispatched_ticks", 0)
        return count

    @admin.display(description="definition")
    def definition_display(self, obj: Schedule) -> SafeString:
        return format_html("<pre>{}</pre>", json.dumps(obj.definition, indent=2, ensure_ascii=False))

    @admin.action(description="Run selected schedules now", permissions=["operate"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        """Dispatch each selected enabled schedule's job now (a manual tick); each run is logged
        in the schedule's admin history. Disabled and removed entries are refused."""
        # The scheduler's code is loaded by the action that runs it, not by every process that
        # loads the admin (a worker's included).
        from ..scheduler import Scheduler
        from ..schedules import ScheduleError

        try:
            scheduler = Scheduler()
        except ScheduleError as exc:  # a bad entry in the settings (the system checks report it too)
            self.message_user(request, f"Nothing was run: {exc}", messages.ERROR)
            return
        ran: list[str] = []
        refused: list[str] = []
        for schedule in queryset:
            if state(schedule) != "enabled":
                refused.append(f"{schedule.name} ({state(schedule)})")
                continue
            try:
                job_id = str(scheduler.run_now(schedule.name))
            except Exception as exc:  # noqa: BLE001 - one entry's failure (a backend down) is reported, the rest run
                self.message_user(request, f"{schedule.name} was not run: {exc}", messages.ERROR)
                continue
            self.log_change(request, schedule, f"Ran now: job {job_id}")
            ran.append(job_id)
        if ran:
            self.message_user(request, ran_message(ran), messages.SUCCESS)
        if refused:
            self.message_user(
                request, f"Not run: {', '.join(refused)}. Only enabled schedules can run.", messages.WARNING
            )
