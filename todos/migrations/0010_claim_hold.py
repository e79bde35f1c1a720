from django.db import migrations

# claim_next's pick on PostgreSQL (todos.transitions.claim_candidate_sql calls it). A claim must
# pass over only the todos other claims hold. A row lock cannot say that: a digest or a ring
# stamping last_ringed_at locks the rows it marks as well, and a pick with SKIP LOCKED passed
# over those and handed out a worse todo. So a claim holds its todo by a transaction-scoped
# advisory lock that only claims take (the two-integer key space, the todo id split into its
# high and low 31 bits, so no other lock can share a key), and a row another claim holds is
# passed over; a row bookkeeping holds is not, and the claim's UPDATE waits the moment it
# takes. Once the lock is granted, any claim that held it has committed, and a VOLATILE
# plpgsql function reads with a fresh snapshot: the row is checked as it is now, not as the
# statement's older snapshot saw it, so a todo claimed a moment ago is passed over too instead
# of failing the claim (docs/work-control.md#priority). ``wait``: a claim by id, which must have
# the lock before it locks its row (a claim_next holding the endpoint's cap lock may be
# waiting for that row). ``cap_endpoint``: the endpoint has caps, and its cap lock (the one
# endpoint_claim_fits takes) is taken first, so concurrent claims of a capped endpoint pick in
# turn: otherwise a claim that passed over the best todo, held by a claim not yet at the cap
# check, could reach the check first and take the last slot with a worse todo.
CLAIM_HOLD_SQL = """
CREATE OR REPLACE FUNCTION todo_claim_hold(candidate bigint, wait boolean DEFAULT FALSE,
                                           cap_endpoint bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF cap_endpoint IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('switchboard.claim_cap', cap_endpoint));
    END IF;
    IF wait THEN
        PERFORM pg_advisory_xact_lock((candidate >> 31)::integer,
                                      (candidate & 2147483647)::integer);
        RETURN TRUE;
    END IF;
    IF NOT pg_try_advisory_xact_lock((candidate >> 31)::integer,
                                     (candidate & 2147483647)::integer) THEN
        RETURN FALSE;
    END IF;
    RETURN EXISTS (SELECT 1 FROM todos_todo WHERE id = candidate AND state = 'pending'
                   AND not_before IS NULL);
END
$$;
"""
DROP_CLAIM_HOLD_SQL = "DROP FUNCTION IF EXISTS todo_claim_hold(bigint, boolean, bigint);"


def _on_postgres(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ("todos", "0009_cancel_approval"),
    ]

    operations = [
        migrations.RunPython(_on_postgres(CLAIM_HOLD_SQL), _on_postgres(DROP_CLAIM_HOLD_SQL)),
    ]
