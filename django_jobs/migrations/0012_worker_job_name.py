from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0011_abort_requested_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="current_job_name",
            field=models.CharField(blank=True, help_text="Its name, or else its handler.", max_length=255),
        ),
    ]
