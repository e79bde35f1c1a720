"""What the board's stream carries: the rows of a committed batch rendered once per board
view and the header's glance entries (their SSE framing is ``switchboard.http.sse``). Sync
functions (the database reads are wrapped with ``database_sync_to_async`` by the hub); the
stream never carries a payload or a secret.
"""

from django.template.loader import render_to_string

from channels_push.sessions import holders

from . import rights


def fetch_board_todos(todo_ids) -> list:
    """The todos of a batch as the board renders them, in one query (endpoint and its owner
    id included). Gone or malformed ids are left out."""
    from todos import queries
    from todos.models import Todo

    ids = [int(todo_id) for todo_id in todo_ids if str(todo_id).isdigit()]
    return list(queries.with_board_version(
        Todo.objects.filter(pk__in=ids).select_related("endpoint")
    ).order_by("id"))


def render_rows(todos, filters: dict, next_url: str) -> list[dict]:
    """Per todo its row HTML (None when it no longer matches the filters, so the page drops
    it), version and its endpoint's owner (who may see it). No query."""
    from todos import queries

    rows = []
    for todo in todos:
        html = None
        if queries.matches_board_filters(todo, **filters):
            # No request here, so no CSRF token: board.js fills the page's token in.
            html = render_to_string(
                "console/_row.html", {"todo": todo, "next_url": next_url, "csrf_token": ""}
            )
        rows.append({
            "todo_id": str(todo.pk),
            "version": todo.version or 0,
            "state": todo.state,
            "html": html,
            "owner_id": todo.endpoint.owner_id,
        })
    return rows


def render_changes(todo_ids, filters: dict, next_url: str) -> list[dict]:
    """The board's view of these todos now, in one query (see ``render_rows``)."""
    return render_rows(fetch_board_todos(todo_ids), filters, next_url)


class RenderedBatch(dict):
    """``{view key: [row]}``, and ``endpoints``: the endpoints the batch touched (their
    header counts are due: ``hub.BoardHub.queue_glance``)."""

    endpoints = ()


def glance_entries(endpoints, *, now=None) -> list[dict]:
    """The board header's entries for ``endpoints`` (``todos.queries.board_glance``, four
    queries whatever their number), JSON-ready, each with ``owner_id`` for the hub to pick
    from per viewer."""
    from todos import queries

    glance = queries.board_glance([endpoint.pk for endpoint in endpoints], now=now)
    return [{"endpoint": endpoint.slug, "owner_id": endpoint.owner_id, **glance[endpoint.pk]}
            for endpoint in endpoints]


def render_batch(todo_ids, views: dict) -> dict:
    """A committed batch for every board view of a process: ONE query for the rows (and one
    for their holders' client names when an agent holds one), then one render per view.
    ``views``: ``{view key: (filters, next_url, audience)}``, where audience is ``[rights.Viewer]``
    of that view's streams: a row no stream of the view may see is not rendered. Returns a
    ``RenderedBatch``."""
    todos = fetch_board_todos(todo_ids)
    holders.label_todo_holders(todos)
    rendered = RenderedBatch()
    for key, (filters, next_url, audience) in views.items():
        seen = [todo for todo in todos
                if any(viewer.may_see(todo.endpoint.owner_id) for viewer in audience)]
        rendered[key] = render_rows(seen, filters, next_url)
    rendered.endpoints = list({todo.endpoint_id: todo.endpoint for todo in todos}.values())
    return rendered


def recheck_and_render_batch(todo_ids, views: dict, viewer_keys) -> tuple[dict, dict]:
    """A committed batch, after its viewers' re-check, in one database hop: ``views`` as for
    ``render_batch`` but with ``[viewer key]`` as each view's audience. Returns ``({viewer
    key: rights.Viewer or None}, {view key: [row]})``: a viewer who lost the right (None) is no
    audience, and a demoted superuser's audience is what they may see now. Three queries
    (users, Django sessions, rows) whatever the number of streams."""
    viewers = rights.recheck_viewers(viewer_keys)
    audiences = {key: (filters, next_url, [viewers[viewer_key] for viewer_key in keys
                                           if viewers.get(viewer_key) is not None])
                 for key, (filters, next_url, keys) in views.items()}
    return viewers, render_batch(todo_ids, audiences)
