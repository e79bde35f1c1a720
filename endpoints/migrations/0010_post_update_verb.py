from django.db import migrations

# post_update (docs/write-back.md#the-living-status) joins every endpoint that may heartbeat:
# it is fenced by the same lease, and its allowlist was written before the verb existed.


def grant_post_update(apps, schema_editor):
    Endpoint = apps.get_model("endpoints", "Endpoint")
    for endpoint in Endpoint.objects.all().only("id", "verbs"):
        if "heartbeat" in endpoint.verbs and "post_update" not in endpoint.verbs:
            endpoint.verbs = [*endpoint.verbs, "post_update"]
            endpoint.save(update_fields=["verbs"])


def revoke_post_update(apps, schema_editor):
    Endpoint = apps.get_model("endpoints", "Endpoint")
    for endpoint in Endpoint.objects.all().only("id", "verbs"):
        if "post_update" in endpoint.verbs:
            endpoint.verbs = [verb for verb in endpoint.verbs if verb != "post_update"]
            endpoint.save(update_fields=["verbs"])


class Migration(migrations.Migration):
    dependencies = [("endpoints", "0009_budget_day_turn_index")]

    operations = [migrations.RunPython(grant_post_update, revoke_post_update)]
