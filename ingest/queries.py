"""Reads of the ingest app used by more than one surface (hook view, operator API, MCP verbs)."""

from cryptography.fernet import InvalidToken

from todos.models import Todo
from todos.transitions import Refusal

from .models import SECRET_REF_PREFIX, OperatorSecret, OperatorToken, Route, Webhook


def find_webhook_with_routes(slug: str) -> tuple[Webhook | None, list[Route]]:
    """The active webhook ``slug`` and its routes with their endpoints, or ``(None, [])``.

    One query on the ingest hot path (routes joined to their webhook and endpoint); a second
    only for a webhook without routes, which is rare and cheap."""
    routes = list(
        Route.objects.filter(webhook__slug=slug, webhook__active=True)
        .select_related("webhook", "endpoint").order_by("id")
    )
    if routes:
        webhook = routes[0].webhook
        for route in routes:
            route.webhook = webhook
        return webhook, routes
    return Webhook.objects.filter(slug=slug, active=True).first(), []


def find_operator_for_token(token: str):
    """The active user holding the unrevoked personal API token ``token``, or None. Looked up by
    digest, then compared again in constant time (as endpoint credentials are)."""
    if not token:
        return None
    row = (
        OperatorToken.objects.select_related("user")
        .filter(digest=OperatorToken.hash(token), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if row is None or not row.matches(token):
        return None
    return row.user


def read_secret(caller, ref) -> dict:
    """The ``read_secret`` agent verb: ``{"ref", "value"}`` for a secret ref found in a todo's
    payload, decrypted.

    ``caller`` is a ``todos.transitions.Caller``: the secret must belong to a todo of
    ``caller.endpoint`` in a queue the caller can see. Refuses ``invalid_argument`` for a
    malformed ref and ``not_found`` otherwise — a secret of a todo outside the caller's endpoint
    or scope is indistinguishable from a missing one. Never logs the value.
    """
    if not isinstance(ref, str) or not ref.startswith(SECRET_REF_PREFIX) or len(ref) > 64:
        raise Refusal("invalid_argument", "ref must be a secret ref (sec_…) from a todo's payload")
    secret = (
        OperatorSecret.objects.filter(ref=ref, todo__endpoint_id=caller.endpoint.pk)
        .only("ref", "ciphertext", "todo_id").first()
    )
    if secret is None:
        raise Refusal("not_found", f"no secret {ref}")
    queue = Todo.objects.filter(pk=secret.todo_id).values_list("queue", flat=True).first()
    if queue is None or not caller.covers(queue):
        raise Refusal("not_found", f"no secret {ref}")
    try:
        value = secret.unseal()
    except InvalidToken:
        # The secrets key changed without keeping the old one (SWITCHBOARD_SECRETS_KEY list).
        raise Refusal("not_found", f"secret {ref} can no longer be decrypted") from None
    return {"ref": ref, "value": value}
