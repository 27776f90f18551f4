from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0010_tick_abandoned"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="abort_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
