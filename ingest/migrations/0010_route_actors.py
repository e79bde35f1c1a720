from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("ingest", "0008_route_priority_delay"),
    ]

    operations = [
        migrations.AddField(
            model_name="route",
            name="actors",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name="route",
            name="author_associations",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AlterField(
            model_name="deliveryrecord",
            name="outcome",
            field=models.CharField(choices=[
                ("accepted", "Accepted"), ("duplicate", "Duplicate"), ("replay", "Replay"),
                ("bad_signature", "Bad Signature"), ("stale_timestamp", "Stale Timestamp"),
                ("malformed", "Malformed"), ("too_large", "Too Large"),
                ("unsupported_type", "Unsupported Type"), ("rate_limited", "Rate Limited"),
                ("no_route", "No Route"), ("filtered", "Filtered")], max_length=20),
        ),
    ]
