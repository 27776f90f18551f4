"""The jobs bench/redis_drain_cost.py drains."""

from django_jobs import current_job, job


@job
def noop(n: int) -> None:
    """Does nothing: the drain is measured, not the work."""


@job(max_retries=1)
def fails_once(n: int) -> None:
    """Fails its first run and succeeds on its second."""
    if current_job().attempt == 1:
        raise RuntimeError("planned failure")
