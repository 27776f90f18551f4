"""The workers panel: every worker process, alive or dead, as it last reported itself."""

from __future__ import annotations

from django.contrib import admin

from ..models import Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("id", "hostname", "pid", "backend", "last_seen")
