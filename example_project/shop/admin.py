from django.contrib import admin

from .models import DemoCounter, Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("id", "sku", "total_cents", "created_at")
    readonly_fields = ("job_ids", "created_at")


@admin.register(DemoCounter)
class DemoCounterAdmin(admin.ModelAdmin):
    list_display = ("key", "value")
