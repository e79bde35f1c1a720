"""list_todos: the live todos first, in pages (CONTRACT §4, issue 13 item 5)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from todos import queries, transitions
from todos.models import State

pytestmark = pytest.mark.django_db


def test_without_a_state_the_live_todos_come_first_not_the_oldest_done(agent, endpoint, make_todo):
    """55 done and 5 pending: the listing returned 50 done ones and no pending."""
    endpoint.max_attempts = 1
    endpoint.save()
    for _ in range(55):
        todo = transitions.claim_todo(agent, make_todo().pk)
        transitions.complete_todo(agent, todo.pk)
    dead = transitions.claim_todo(agent, make_todo().pk)
    transitions.fail_todo(agent, dead.pk)  # a dead letter: not live
    endpoint.max_attempts = 5
    endpoint.save()
    waiting = transitions.claim_todo(agent, make_todo().pk)
    transitions.fail_todo(agent, waiting.pk)  # failed, waiting to retry
    claimed = transitions.claim_todo(agent, make_todo().pk)
    pending = [make_todo() for _ in range(5)]
    rows, next_cursor = queries.list_todos(agent)
    assert [row.pk for row in rows] == [t.pk for t in pending] + [claimed.pk, waiting.pk]
    assert next_cursor is None
    assert len(queries.list_todos(agent, state=State.DONE, limit=200)[0]) == 55
    assert [r.pk for r in queries.list_todos(agent, state=State.FAILED)[0]] == [dead.pk, waiting.pk]


def test_pages_list_a_queue_of_500_whole_once_each(agent, make_todo):
    now = timezone.now()
    made = [make_todo(now=now + timedelta(microseconds=i // 3)).pk for i in range(500)]  # ties
    for todo_id in made[:7]:
        transitions.claim_todo(agent, todo_id)
    seen, cursor, pages = [], None, 0
    while True:
        rows, cursor = queries.list_todos(agent, limit=37, cursor=cursor)
        seen += [row.pk for row in rows]
        pages += 1
        if cursor is None:
            break
    assert pages == 14 and len(seen) == 500 and len(set(seen)) == 500
    assert seen == made[7:] + made[:7]  # pending first, then the claimed ones


def test_a_cursor_continues_only_its_own_listing(agent, make_todo):
    for _ in range(3):
        make_todo()
    _, cursor = queries.list_todos(agent, limit=1)
    assert len(queries.list_todos(agent, limit=5, cursor=cursor)[0]) == 2
    for bad in ("", "nonsense", cursor[:-3], cursor + "x"):
        with pytest.raises(ValueError):
            queries.list_todos(agent, cursor=bad)
    with pytest.raises(ValueError):
        queries.list_todos(agent, state=State.PENDING, cursor=cursor)


def test_parse_todo_id_takes_ascii_decimal_text_or_an_int_within_a_bigint():
    for given, expected in (("42", 42), (42, 42), (str(2**63 - 1), 2**63 - 1)):
        assert queries.parse_todo_id(given) == expected
    for given in ("٤٢", "²", " 4", "4 ", "-4", "0", 0, -3, 2**63, "9" * 20, True, 4.0, None, ""):
        assert queries.parse_todo_id(given) is None, given
