from django.db import migrations, models

# The heartbeat sweep's partial index (channels_push.sweeps.ring_due_todos). It lives on the
# todos table but is created here because only the doorbell reads it: pending, push-eligible
# todos with ring budget left, per endpoint, by the time the backoff counts from
# (last_ringed_at, else created_at). Claimed, done and unverified rows — nearly all of history —
# never enter it, so the sweep's cost follows the waiting backlog, not the table.
DOORBELL_INDEX = "todo_doorbell_due"
DOORBELL_INDEX_SQL = (
    f"CREATE INDEX {DOORBELL_INDEX} ON todos_todo "
    "(endpoint_id, (COALESCE(last_ringed_at, created_at))) "
    "WHERE state = 'pending' AND ring_attempts < 5 AND trust IN ('signed', 'operator')"
)


def create_doorbell_index(apps, schema_editor):
    schema_editor.execute(DOORBELL_INDEX_SQL)
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"COMMENT ON INDEX {DOORBELL_INDEX} IS "
            "'heartbeat sweep: channels_push.sweeps.ring_due_todos'"
        )


def drop_doorbell_index(apps, schema_editor):
    schema_editor.execute(f"DROP INDEX IF EXISTS {DOORBELL_INDEX}")


class Migration(migrations.Migration):

    dependencies = [
        ('channels_push', '0001_initial'),
        ('todos', '0002_todoevent_single_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='mcpsession',
            name='last_doorbell_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(create_doorbell_index, drop_doorbell_index),
    ]
