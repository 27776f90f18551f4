from django.core.management.base import BaseCommand
from django.db import transaction

from shop.jobs import charge_card, send_receipt, sync_inventory
from shop.models import Order


class Command(BaseCommand):
    help = "Create an order and dispatch the three demo jobs for it."

    def handle(self, *args, **options):
        # Database backend: the jobs are inserted in the same transaction as the order,
        # so a worker never sees a job for an order that does not exist yet.
        with transaction.atomic():
            order = Order.objects.create(sku="pending", total_cents=4200)
            order.sku = f"WIDGET-{order.pk}"  # a fresh SKU per run keeps the demo repeatable
            order.job_ids = {
                "send_receipt": send_receipt.dispatch(order_id=order.pk),
                "sync_inventory": sync_inventory.dispatch(sku=order.sku),
                "charge_card": charge_card.dispatch(order_id=order.pk),
            }
            order.save()

        ids = order.job_ids
        self.stdout.write(f"Created order #{order.pk} ({order.sku}) and dispatched:")
        self.stdout.write(f"  send_receipt    {ids['send_receipt']}  queue emails   expect: completed after 1 attempt")
        self.stdout.write(
            f"  sync_inventory  {ids['sync_inventory']}  queue default  "
            "expect: fails twice (backoff ~1 s, then ~2 s), completed after 3 attempts"
        )
        self.stdout.write(
            f"  charge_card     {ids['charge_card']}  queue default  "
            "expect: 'card declined' twice, failed after 2 attempts"
        )
        self.stdout.write("That is 6 deliveries: 1 + 3 + 2.")
