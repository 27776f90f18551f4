from django.db import models


class Order(models.Model):
    """A tiny order; each ``manage.py demo_dispatch`` creates one."""

    sku = models.CharField(max_length=64)
    total_cents = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    # Ids of the demo jobs dispatched for this order, e.g. {"send_receipt": "3f2a..."},
    # so ``manage.py demo_report`` can find them again.
    job_ids = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"Order #{self.pk} ({self.sku})"


class DemoCounter(models.Model):
    """A named counter kept in the database.

    ``shop.jobs.sync_inventory`` counts its own attempts here: a worker process may
    restart between two attempts, so a counter in process memory would not do.
    """

    key = models.CharField(max_length=100, unique=True)
    value = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.key} = {self.value}"
