from django.db import migrations

# cancel (docs/work-control.md#threads) joins every endpoint that may complete: it is fenced by
# the same lease, and its allowlist was written before the verb existed.


def grant_cancel(apps, schema_editor):
    Endpoint = apps.get_model("endpoints", "Endpoint")
    for endpoint in Endpoint.objects.all().only("id", "verbs"):
        if "complete" in endpoint.verbs and "cancel" not in endpoint.verbs:
            endpoint.verbs = [*endpoint.verbs, "cancel"]
            endpoint.save(update_fields=["verbs"])


def revoke_cancel(apps, schema_editor):
    Endpoint = apps.get_model("endpoints", "Endpoint")
    for endpoint in Endpoint.objects.all().only("id", "verbs"):
        if "cancel" in endpoint.verbs:
            endpoint.verbs = [verb for verb in endpoint.verbs if verb != "cancel"]
            endpoint.save(update_fields=["verbs"])


class Migration(migrations.Migration):
    dependencies = [("endpoints", "0010_post_update_verb")]

    operations = [migrations.RunPython(grant_cancel, revoke_cancel)]
