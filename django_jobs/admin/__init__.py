"""The admin: the operator's console. Jobs (failed ones kept for audit, retryable), the
dashboard, and the workers panel."""

from .dashboard import JobDashboardAdmin
from .jobs import SUMMARY_CHARS, JobAdmin, duration_text, first_line, retry_message
from .schedules import ScheduleAdmin
from .workers import WorkerAdmin

__all__ = [
    "SUMMARY_CHARS",
    "JobAdmin",
    "JobDashboardAdmin",
    "ScheduleAdmin",
    "WorkerAdmin",
    "duration_text",
    "first_line",
    "retry_message",
]
