"""The jobs dashboard, listed on the admin index as "Dashboard" (a proxy of ``Job``); its page
is built by ``dashboard_page``, imported when the page is asked for."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

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
        """The dashboard, its figures read now."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        from .dashboard_page import dashboard_context  # its queries and charts: on request only

        context = {
            **self.admin_site.each_context(request),
            "title": "Jobs dashboard",
            "opts": self.model._meta,
            **dashboard_context(timezone.now()),
            # The workers panel needs a permission of its own: no link that would answer 403.
            "workers_url": (
                reverse("admin:django_jobs_worker_changelist")
                if request.user.has_perm("django_jobs.view_worker")
                else None
            ),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_jobs/jobdashboard/dashboard.html", context)
