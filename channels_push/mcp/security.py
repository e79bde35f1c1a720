"""Who may use an MCP endpoint: the Origin check, the bearer credential (read in the same
statement as the request's session), the per-address failure budget and the rate limit.
Every request passes ``authorize`` before anything else is done for it.
"""

import logging
import re
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from channels_push.sessions import transitions as session_transitions
from endpoints.models import hash_credential
from switchboard import ratelimit
from switchboard.http import origins, plain
from todos import queries as todo_queries
from todos.models import TODO_TOKEN_PREFIX

from .framing import fault

log = logging.getLogger("switchboard.mcp")

# A request refreshes its session's last-seen time at most this often (the idle limit is an
# hour; see transitions.touch_session for why not on every call).
SESSION_TOUCH_INTERVAL = timedelta(seconds=30)
# Mcp-Session-Id values we mint are 43 URL-safe characters; anything that is not visible ASCII
# or is longer than the column cannot be one of ours.
SESSION_ID_RE = re.compile(r"^[\x21-\x7e]{1,64}$")


def origin_allowed(origin: str | None) -> bool:
    """Absent Origin (non-browser clients) is allowed. A present one must equal, as (scheme,
    host, port), one of SWITCHBOARD_ALLOWED_ORIGINS (the public URL's origin plus the configured
    extras): that is what stops a web page — another local port, a rebound DNS name — from
    driving an agent's endpoint. Anything unparseable, ``null`` included, is refused."""
    if origin is None:
        return True
    parsed = origins.parse_origin(origin)
    return parsed is not None and parsed in settings.SWITCHBOARD_ALLOWED_ORIGINS


def bearer_of(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# Bearer digests this process accepted, and until when they pass an address's failure block:
# only a lookup hint (every request still checks its credential in the database), bounded.
ACCEPTED_BEARER_MEMORY_SECONDS = 600.0
_accepted_bearers: dict[str, float] = {}


def _recently_accepted(digest: str) -> bool:
    return bool(digest) and _accepted_bearers.get(digest, 0.0) > time.monotonic()


def _note_accepted(digest: str) -> None:
    _accepted_bearers.pop(digest, None)  # re-insert: dict order is recency
    _accepted_bearers[digest] = time.monotonic() + ACCEPTED_BEARER_MEMORY_SECONDS
    while len(_accepted_bearers) > ratelimit.MAX_LOCAL_BUCKETS:
        _accepted_bearers.pop(next(iter(_accepted_bearers)))


def authorize(request: plain.Request, *, rate_limited: bool = True):
    """Origin, bearer, rate limit. Returns (endpoint, None) or (None, refusal Answer). The
    request's session is read in the same statement as the bearer (see ``handlers._live_session``).
    ``rate_limited=False``: a woken long poll re-checks its bearer without taking a second
    token for the one request it is."""
    if not origin_allowed(request.header("origin")):
        return None, fault(403, "Forbidden: Origin not allowed")
    credential = bearer_of(request.header("authorization"))
    digest = hash_credential(credential) if credential else ""
    # Unknown slugs and bad bearers spend their address's budget, not a query; a bearer accepted
    # recently still reaches its check, so bad ones from a shared address lock out nobody good.
    refused = ratelimit.refuse_failing_client("mcp-auth", request.client)
    if not refused.allowed and not _recently_accepted(digest):
        return None, fault(429, "Too Many Requests",
                           headers={"Retry-After": str(refused.retry_after_seconds)})
    endpoint = _find_endpoint(request, credential or "")
    if endpoint is None:
        refused = ratelimit.charge_client_failure(
            "mcp-auth", request.client, per_minute=settings.SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE)
        if not refused.allowed:
            return None, fault(429, "Too Many Requests",
                               headers={"Retry-After": str(refused.retry_after_seconds)})
        # Same answer for a missing, wrong, expired or other endpoint's credential; a todo
        # token's (its prefix is the caller's own) says when such tokens work, not why.
        message = ("Unauthorized: a todo token works only for its own todo while that lease "
                   "lasts" if credential and credential.startswith(TODO_TOKEN_PREFIX)
                   else "Unauthorized: a valid bearer credential for this endpoint is required")
        return None, fault(401, message, headers={"WWW-Authenticate": 'Bearer realm="switchboard"'})
    _note_accepted(digest)
    if not rate_limited:
        return endpoint, None
    # A todo token spends its endpoint's budget: every todo token of one endpoint shares one,
    # so claiming more todos buys an agent no more requests.
    bucket = digest if endpoint.todo_grant is None else f"todo-tokens:{endpoint.pk}"
    decision = ratelimit.take_token("mcp", bucket,
                                      per_minute=settings.SWITCHBOARD_MCP_RATE_PER_MINUTE)
    if not decision.allowed:
        log.info("mcp rate limited", extra={"endpoint": endpoint.slug})
        return None, fault(429, "Too Many Requests",
                           headers={"Retry-After": str(decision.retry_after_seconds)})
    return endpoint, None


def _find_endpoint(request: plain.Request, credential: str):
    """The endpoint the bearer opens, with its session's state read in the same statement: an
    endpoint credential (``todo_grant`` None), or a todo token (``todo_grant`` says which todo
    and lease it may act on; docs/security.md#the-todo-token)."""
    session_id = _session_id_of(request)
    if not credential.startswith(TODO_TOKEN_PREFIX):
        endpoint = session_transitions.find_endpoint_with_session(
            slug=request.slug, credential=credential, session_id=session_id,
            fresh_within=SESSION_TOUCH_INTERVAL)
        if endpoint is not None:
            endpoint.todo_grant = None
        return endpoint
    now = timezone.now()
    return todo_queries.find_endpoint_for_todo_token(
        request.slug, credential, now=now,
        **session_transitions.session_join(session_id=session_id, bound_to="s.todo_token_id = k.id",
                                           fresh_within=SESSION_TOUCH_INTERVAL, now=now))


def _session_id_of(request: plain.Request) -> str | None:
    """The Mcp-Session-Id header when it could be one of ours, else None."""
    session_id = request.header("mcp-session-id")
    return session_id if session_id and SESSION_ID_RE.match(session_id) else None

