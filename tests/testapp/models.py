from django.db import models


class SideEffect(models.Model):
    """One row per run of a scripted job: counts how often each job really executed."""

    key = models.CharField(max_length=100, db_index=True)
    attempt = models.IntegerField(default=0)
    pid = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
