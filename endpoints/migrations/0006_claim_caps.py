from django.db import migrations, models

# The claim statement's capacity guard on PostgreSQL (todos.transitions.claim_cap_guard_sql
# calls it). It must count the claimed todos AFTER taking the endpoint's lock, and under READ
# COMMITTED a plain sub-select in the claim statement cannot: it reads the statement's
# snapshot, taken before the lock was granted, so a claim that waited for the lock would not
# see the claim that held it and both would pass (measured: counted 0 with 1 committed). A
# VOLATILE plpgsql function takes a fresh snapshot for each query it runs, so its count sees
# every claim committed before the lock was granted. The transaction-scoped lock is held until
# the claim commits, so the next claimer counts it. SQLite needs none of this: its single
# writer serializes claims, and the guard there is a sub-select (docs/work-control.md#caps).
CLAIM_FITS_SQL = """
CREATE OR REPLACE FUNCTION endpoint_claim_fits(endpoint bigint, claim_queue text,
                                               max_claimed integer, queue_limit integer)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF max_claimed IS NULL AND queue_limit IS NULL THEN
        RETURN TRUE;
    END IF;
    -- One lock per endpoint: both of its caps are checked under it.
    PERFORM pg_advisory_xact_lock(hashtextextended('switchboard.claim_cap', endpoint));
    RETURN (SELECT (max_claimed IS NULL OR count(*) < max_claimed)
                   AND (queue_limit IS NULL
                        OR count(*) FILTER (WHERE queue = claim_queue) < queue_limit)
            FROM todos_todo WHERE endpoint_id = endpoint AND state = 'claimed');
END
$$;
"""
DROP_CLAIM_FITS_SQL = "DROP FUNCTION IF EXISTS endpoint_claim_fits(bigint, text, integer, integer);"


def _on_postgres(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ("endpoints", "0004_pause_work"),
    ]

    operations = [
        migrations.AddField(
            model_name="endpoint",
            name="max_claimed",
            field=models.PositiveIntegerField(
                blank=True, null=True,
                help_text="At most this many todos claimed at once (empty: unlimited)."),
        ),
        migrations.AddField(
            model_name="endpoint",
            name="queue_limits",
            field=models.JSONField(
                blank=True, default=dict,
                help_text='Per-queue caps on claimed todos, e.g. {"deploys": 1}.'),
        ),
        migrations.RunPython(_on_postgres(CLAIM_FITS_SQL), _on_postgres(DROP_CLAIM_FITS_SQL)),
    ]
