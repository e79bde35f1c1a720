"""What a query-plan assertion needs first (docs/testing.md, "Deterministic under load")."""


def analyze_every_table(cursor) -> None:
    """ANALYZE the whole test database inside the test's transaction, so that every table a
    planned statement reads is described by the rows this test can see, and by nothing else.

    A plan depends on every table of the statement, not only the one the test filled, and a
    worker's test database keeps what earlier tests left: the dead pages of their rolled-back
    bulk inserts, which the planner takes for rows until an ANALYZE has looked, and the row
    counts an ANALYZE inside their transaction wrote in place, which their rollback did not
    undo. The same assertion then passed alone and failed after other tests."""
    cursor.execute("ANALYZE")
