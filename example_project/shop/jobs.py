"""The demo's background jobs.

Workers import this module by themselves (django-jobs autodiscovers every installed
app's ``jobs`` module), so each ``@job`` below is registered before the first fetch.
"""

import logging

from django.db.models import F

from django_jobs import job

from .models import DemoCounter

logger = logging.getLogger(__name__)


@job(queue="emails")
def send_receipt(order_id: int) -> None:
    """Succeeds on its first attempt."""
    logger.info("send_receipt: receipt for order #%s sent", order_id)


@job(max_retries=3)
def sync_inventory(sku: str) -> None:
    """Fails on attempts 1 and 2 and succeeds on attempt 3.

    The attempt number is counted in a ``DemoCounter`` row, not in memory, so the
    outcome is the same whichever worker process runs each attempt.
    """
    key = f"sync_inventory:{sku}"
    DemoCounter.objects.get_or_create(key=key)
    DemoCounter.objects.filter(key=key).update(value=F("value") + 1)
    attempt = DemoCounter.objects.get(key=key).value
    if attempt < 3:
        logger.warning("sync_inventory: attempt %s for %s: warehouse API timed out", attempt, sku)
        raise ConnectionError(f"warehouse API timed out (attempt {attempt})")
    logger.info("sync_inventory: attempt %s for %s: stock levels synced", attempt, sku)


@job(max_retries=1)
def charge_card(order_id: int) -> None:
    """Always fails: after 2 attempts it ends ``failed`` and shows in the admin."""
    logger.warning("charge_card: charging order #%s ...", order_id)
    raise RuntimeError("card declined")
