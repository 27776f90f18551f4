"""The ``Job`` table: the database backend's queue, and the audit trail of every failure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

if TYPE_CHECKING:
    from .envelope import Envelope


class JobStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    IN_PROGRESS = "in_progress", "In progress"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"


# The columns that hold a job's own message fields; the others are its state in the table.
ENVELOPE_COLUMNS = (
    "queue", "handler", "payload", "options", "signature", "name", "max_retries", "priority", "timeout",
    "idempotency_key",
)  # fmt: skip


def envelope_columns(envelope: Envelope) -> dict[str, Any]:
    """A ``Job`` row's message columns, from ``envelope`` (its id aside)."""
    return {column: getattr(envelope, column) for column in ENVELOPE_COLUMNS}


class Job(models.Model):
    id = models.CharField(primary_key=True, max_length=64, editable=False)
    queue = models.CharField(max_length=100)
    handler = models.CharField(max_length=255)
    payload = models.JSONField(default=dict, blank=True)
    # Per-job behaviour that travels with the message (backoff, retry_on, single_instance).
    options = models.JSONField(default=dict, blank=True)
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
