"""The job table's JSON columns written by ``FloatKeepingEncoder``: no change to the schema."""

from django.db import migrations, models

import django_jobs.jsoncolumns


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0014_fewer_job_index_writes"),
    ]

    operations = [
        migrations.AlterField(
            model_name="job",
            name="options",
            field=models.JSONField(blank=True, default=dict, encoder=django_jobs.jsoncolumns.FloatKeepingEncoder),
        ),
        migrations.AlterField(
            model_name="job",
            name="payload",
            field=models.JSONField(blank=True, default=dict, encoder=django_jobs.jsoncolumns.FloatKeepingEncoder),
        ),
        migrations.AlterField(
            model_name="job",
            name="result",
            field=models.JSONField(blank=True, encoder=django_jobs.jsoncolumns.FloatKeepingEncoder, null=True),
        ),
    ]
