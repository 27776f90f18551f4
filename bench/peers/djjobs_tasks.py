"""django-jobs: the no-op ``@job`` (settings: ``peers.settings``)."""

from django_jobs import job
from peers.common import record


@job
def noop() -> None:
    record()
