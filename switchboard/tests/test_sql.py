"""switchboard/db/sql.py: each backend fragment means the same on PostgreSQL and on SQLite."""

from datetime import datetime, timedelta, timezone

import pytest
from django.db import connection

from switchboard.db import sql as dialect

NAMES = ("inbox", 'we"ird', "back\\slash", "a,b", "{braces}", "spa ce")


def select_one(text: str, params: dict):
    with connection.cursor() as cursor:
        cursor.execute(text, params)
        return cursor.fetchone()[0]


def test_queue_lists_reach_the_database_as_the_exact_names(db):
    if not dialect.is_postgres():
        pytest.skip("the text[] literal is PostgreSQL's; SQLite gets a JSON list")
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::text[]", [dialect.text_list(NAMES)])
        assert tuple(cursor.fetchone()[0]) == NAMES


@pytest.mark.parametrize("name, inside", [('we"ird', True), ("a,b", True), ("a", False)])
def test_a_name_is_in_a_text_list_exactly_when_it_is_one_of_its_names(db, name, inside):
    where = dialect.text_in("%(name)s", "names")
    found = select_one(f"SELECT COUNT(*) FROM (SELECT 1 AS one) x WHERE {where}",
                       {"name": name, "names": dialect.text_list(NAMES)})
    assert found == (1 if inside else 0)


def test_an_id_is_in_an_id_list_exactly_when_it_is_one_of_its_ids(db):
    params = {"wanted": 7}
    where = dialect.id_in("%(wanted)s", "ids", params, [3, 7, 11])
    assert select_one(f"SELECT COUNT(*) FROM (SELECT 1 AS one) x WHERE {where}", params) == 1
    params = {"wanted": 8}
    where = dialect.id_in("%(wanted)s", "ids", params, [3, 7, 11])
    assert select_one(f"SELECT COUNT(*) FROM (SELECT 1 AS one) x WHERE {where}", params) == 0


def test_time_arithmetic_gives_the_same_instant_on_either_backend(db):
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    params = {"at": dialect.db_time(at), "gap": dialect.db_duration(timedelta(minutes=2)),
              "later": dialect.db_time(at + timedelta(minutes=2)),
              "earlier": dialect.db_time(at - timedelta(seconds=90))}
    later = dialect.plus_duration("at", "%(gap)s")
    earlier = dialect.minus_seconds("at", "90")
    assert select_one(f"SELECT CASE WHEN {later} = %(later)s THEN 1 ELSE 0 END", params) == 1
    assert select_one(f"SELECT CASE WHEN {earlier} = %(earlier)s THEN 1 ELSE 0 END", params) == 1


def test_rows_are_locked_skipping_others_only_on_postgresql(db):
    if dialect.is_postgres():
        assert dialect.skip_locked() == " FOR UPDATE SKIP LOCKED"
        assert dialect.skip_locked(of="a") == " FOR UPDATE OF a SKIP LOCKED"
    else:
        assert dialect.skip_locked() == dialect.skip_locked(of="a") == ""
