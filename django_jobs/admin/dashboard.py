"""The jobs dashboard, listed on the admin index as "Dashboard" (a proxy of ``Job``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from .. import dashboard
from ..models import JobDashboard


@admin.register(JobDashboard)
class JobDashboardAdmin(admin.ModelAdmin):
    """Its changelist is the dashboard; whoever may view jobs may view it."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        allowed: bool = request.user.has_perm("django_jobs.view_job") or request.user.has_perm("django_jobs.change_job")
        return allowed

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """Counts per queue and status, and completed/failed jobs per hour."""
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Jobs dashboard",
            "opts": self.model._meta,
            "queues": dashboard.queue_counts(),
            "hours": dashboard.hourly_throughput(),
            "changelist": reverse("admin:django_jobs_job_changelist"),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_jobs/job/dashboard.html", context)
