from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0012_worker_job_name"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedule",
            name="last_pass_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When a scheduler with this entry in its settings last passed (every 15 s).",
                null=True,
            ),
        ),
    ]
