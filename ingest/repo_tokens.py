"""Repository tokens for agents (docs/write-back.md#repository-tokens-for-agents): a GitHub App
installation token for the one repository a todo came from, with only the permissions its
route grants, minted for the agent holding the todo's lease and revoked when that lease ends.

The token is stored (sealed) before it is answered, so the revocation sweep knows every token
it must revoke: a worker that dies after minting leaves the row, and the next pass revokes it.
"""

import logging
from datetime import timedelta

from django.db import models
from django.utils import timezone

from todos import queries as todo_queries
from todos.models import State, Todo
from todos.transitions import Refusal

from . import outbound
from .models import RepoToken, Route
from .senders import github

log = logging.getLogger("switchboard.ingest")

# A token is handed again to the same lease while it has more than this left, so an agent
# never starts a push with a token about to lapse.
REUSE_MARGIN = timedelta(minutes=5)
# A revocation pass takes at most this many tokens: each is a request to GitHub (10 s timeout at
# worst), and leases end far more slowly than this drains them.
REVOKE_BATCH = 50


def _held_todo(caller, todo_id, lease_id, now) -> Todo:
    """The caller's todo under its unexpired lease, with its webhook's connection loaded:
    ``not_found`` outside the caller's endpoint and scope, ``lease_lost`` when not held."""
    text = str(todo_id)
    if not text.isdigit() or len(text) > 18:
        raise Refusal("not_found", f"todo {text[:40]} not found")
    todo = (Todo.objects.filter(pk=int(text), endpoint=caller.endpoint)
            .select_related("delivery_event__webhook__connection").first())
    if todo is None or not caller.covers(todo.queue):
        raise Refusal("not_found", f"todo {text} not found")
    held = todo.lease_id == lease_id if lease_id else todo.lease_owner == caller.actor
    if not (todo.state == State.CLAIMED and held and todo.lease_expires_at
            and todo.lease_expires_at > now):
        raise Refusal("lease_lost", f"todo {todo.pk}: you hold no lease on it; a repository "
                                    "token is only for the lease holder")
    return todo


def _grant_of(todo: Todo):
    """``(connection, route permissions, installation id, owner, repository name)`` for a todo
    whose route grants repository tokens; ``verb_not_allowed`` saying why not otherwise."""
    webhook = todo.delivery_event.webhook if todo.delivery_event else None
    connection = webhook.connection if webhook is not None else None
    if connection is None or connection.kind != "github_app":
        raise Refusal("verb_not_allowed", f"todo {todo.pk} did not come from a webhook with a "
                                          "GitHub App connection; no repository token for it")
    route = Route.objects.filter(webhook=webhook, endpoint_id=todo.endpoint_id,
                                 queue=todo.queue).first()
    if route is None or not route.agent_permissions:
        raise Refusal("verb_not_allowed", f"the route of todo {todo.pk} grants agents no "
                                          "repository token (its operator sets "
                                          "--agent-permissions)")
    payload = todo.payload if isinstance(todo.payload, dict) else {}
    repository = payload.get("repository") if isinstance(payload.get("repository"), dict) else {}
    owner = repository.get("owner") if isinstance(repository.get("owner"), dict) else {}
    installation = payload.get("installation") if isinstance(payload.get("installation"), dict) else {}
    try:
        names = (outbound.number_segment(installation.get("id")),
                 outbound.name_segment(owner.get("login")),
                 outbound.name_segment(repository.get("name")))
    except outbound.SourceError:
        raise Refusal("verb_not_allowed", f"todo {todo.pk}'s delivery names no repository and "
                                          "App installation") from None
    return connection, route.agent_permissions, *names


def _answer(row: RepoToken) -> dict:
    return {"token": row.token, "expires_at": todo_queries.iso_time(row.expires_at),
            "repository": row.repository, "permissions": row.permissions}


def get_repo_token(caller, todo_id, *, lease_id=None, now=None) -> dict:
    """The ``repo_token`` agent verb: ``{"token", "expires_at", "repository",
    "permissions"}`` for the caller's claimed todo, fenced like heartbeat. The lease's token
    when it has more than REUSE_MARGIN left, else a new one from GitHub, recorded (sealed)
    before it is answered. Refuses ``not_found``, ``lease_lost``, and ``verb_not_allowed``
    (no GitHub App connection, no ``agent_permissions`` on the route, or GitHub refused)."""
    now = now or timezone.now()
    todo = _held_todo(caller, todo_id, lease_id, now)
    connection, permissions, installation, owner, name = _grant_of(todo)
    reusable = (RepoToken.objects.filter(todo=todo, lease_id=todo.lease_id, connection=connection,
                                         revoked_at__isnull=True,
                                         expires_at__gt=now + REUSE_MARGIN)
                .order_by("-expires_at").first())
    if reusable is not None and reusable.requested_permissions == permissions and reusable.token:
        return _answer(reusable)
    try:
        token, expires_at, granted = github.mint_repository_token(
            connection, installation, name, permissions, now)
    except outbound.SourceError as failed:
        log.info("repository token refused", extra={"todo_id": todo.pk, "status": failed.status})
        raise Refusal("verb_not_allowed", "GitHub did not mint a repository token "
                                          f"({failed.message[:200]})") from None
    row = RepoToken.objects.create(todo=todo, lease_id=todo.lease_id, connection=connection,
                                   repository=f"{owner}/{name}", permissions=granted,
                                   requested_permissions=permissions, token=token,
                                   issued_at=now, expires_at=expires_at)
    log.info("repository token issued", extra={"todo_id": todo.pk, "token_id": row.pk})
    return _answer(row)


def revoke_ended_repo_tokens(*, now=None, limit: int = REVOKE_BATCH) -> int:
    """Revoke at GitHub (``DELETE /installation/token``) at most ``limit`` repository tokens
    whose lease has ended (settled, released, lapsed, overridden) and stamp ``revoked_at``; a
    token past its expiry is only stamped. A refusal is kept in ``revoke_error`` and retried
    next pass. Safe when two runs overlap: a second DELETE of a revoked token is a 401, which
    counts as revoked, and the stamp is guarded. Returns how many it stamped."""
    now = now or timezone.now()
    lease_held = models.Exists(Todo.objects.filter(
        pk=models.OuterRef("todo_id"), state=State.CLAIMED, lease_id=models.OuterRef("lease_id"),
        lease_expires_at__gt=now))
    due = list(RepoToken.objects.filter(revoked_at__isnull=True)
               .filter(~lease_held | models.Q(expires_at__lte=now))
               .select_related("connection").order_by("issued_at")[:limit])
    stamped = 0
    for row in due:
        if row.expires_at > now and row.token:
            try:
                github.revoke_installation_token(row.connection, row.token, now)
            except outbound.SourceError as failed:
                RepoToken.objects.filter(pk=row.pk).update(revoke_error=failed.message[:300])
                continue
        stamped += RepoToken.objects.filter(pk=row.pk, revoked_at__isnull=True).update(
            revoked_at=now, revoke_error="")
    return stamped
