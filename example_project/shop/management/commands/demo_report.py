from django.core.management.base import BaseCommand, CommandError
from django.urls import reverse

from django_jobs.models import Job, JobAttempt
from shop.models import Order

# job -> (final status, attempts) that the demo is built to produce
EXPECTED = {
    "send_receipt": ("completed", 1),
    "sync_inventory": ("completed", 3),
    "charge_card": ("failed", 2),
}


class Command(BaseCommand):
    help = "Show the final status of the demo jobs of an order (the latest one by default)."

    def add_arguments(self, parser):
        parser.add_argument("--order", type=int, help="order id (default: the latest order)")
        parser.add_argument("--check", action="store_true", help="exit 1 unless every job ended as expected")

    def handle(self, *args, **options):
        orders = Order.objects.order_by("-pk")
        if options["order"] is not None:
            orders = orders.filter(pk=options["order"])
        order = orders.first()
        if order is None or not order.job_ids:
            raise CommandError("No demo order found: run `python manage.py demo_dispatch` first.")

        self.stdout.write(f"Demo jobs of order #{order.pk} ({order.sku}):")
        ok = True
        for name, (want_status, want_attempts) in EXPECTED.items():
            job = Job.objects.filter(pk=order.job_ids.get(name)).first()
            if job is None:
                ok = False
                self.stdout.write(self.style.ERROR(f"  {name:<15} missing job row"))
                continue
            line = f"  {name:<15} {job.status:<10} after {job.attempts} attempt(s) (max_retries={job.max_retries})"
            if job.finished_at and job.created_at:
                settled = (job.finished_at - job.created_at).total_seconds()
                line += f", settled {settled:.1f}s after dispatch"
            good = (job.status, job.attempts) == (want_status, want_attempts)
            ok = ok and good
            style = self.style.SUCCESS if good else self.style.ERROR
            expect = "as expected" if good else f"EXPECTED {want_status} after {want_attempts}"
            self.stdout.write(style(f"{line}  [{expect}]"))
            if job.status == "failed" and job.last_error:
                self.stdout.write(f"  {'':<15} last error: {job.last_error.splitlines()[0]}")
                # The attempt history the admin shows on the job's page: one record per run.
                outcomes = list(
                    JobAttempt.objects.filter(job_id=job.pk).order_by("id").values_list("outcome", flat=True)
                )
                ok = ok and len(outcomes) == job.attempts
                self.stdout.write(f"  {'':<15} attempt history: {', '.join(outcomes) or 'none'}")
                url = reverse("admin:django_jobs_job_change", args=[job.pk])
                self.stdout.write(f"  {'':<15} in the admin: http://127.0.0.1:8000{url}")

        if options["check"] and not ok:
            raise CommandError("Some demo jobs did not end as expected.", returncode=1)
