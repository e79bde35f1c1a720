"""MCP sessions as database rows (docs/reference.md#sessions-and-streams).

A session lives in the database, not in a process's memory, so it survives a restart of the
web process and any web process can serve any request of it (no sticky routing).
"""

import secrets

from django.db import models
from django.db.models import Q

# 32 bytes of entropy -> 43 URL-safe characters: visible ASCII (0x21-0x7E) as the Streamable
# HTTP spec requires of Mcp-Session-Id, and also a legal channel-layer group name suffix.
SESSION_ID_BYTES = 32


def mint_session_id() -> str:
    return secrets.token_urlsafe(SESSION_ID_BYTES)


class McpSession(models.Model):
    id = models.CharField(primary_key=True, max_length=64, default=mint_session_id, editable=False)
    endpoint = models.ForeignKey(
        "endpoints.Endpoint", on_delete=models.CASCADE, related_name="mcp_sessions"
    )
    # Every request and keep-alive must present it while it gives its rights; null only for
    # sessions minted before binding existed, which no credential matches.
    credential = models.ForeignKey(
        "endpoints.Credential", on_delete=models.CASCADE, null=True, blank=True,
        related_name="mcp_sessions",
    )
    # A session opened with a todo's own token (docs/security.md#the-todo-token) instead of a
    # credential: it may act on that todo only, and is never rung.
    # No database constraint: an ended session may outlive its token's todo until the
    # session prune takes it.
    todo_token = models.ForeignKey(
        "todos.TodoToken", on_delete=models.DO_NOTHING, null=True, blank=True,
        related_name="mcp_sessions", db_constraint=False,
    )
    protocol_version = models.CharField(max_length=32)
    # The client's own ``clientInfo`` from initialize (sanitised and capped at
    # CLIENT_INFO_MAX_CHARS), so operators see which agent holds a lease instead of a token.
    client_name = models.CharField(max_length=200, blank=True)
    client_version = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    terminated_at = models.DateTimeField(null=True, blank=True)
    # Open notification streams across all processes; a crashed process leaves it high until
    # the idle-session sweep corrects it.
    open_streams = models.PositiveIntegerField(default=0)
    # Granted at attach, never renewed: ``open_streams`` counts while this or its process's
    # StreamHost lease runs, so streams that died with their process stop counting in time.
    stream_lease_until = models.DateTimeField(null=True, blank=True)
    # Stamped in the UPDATE that picks the least recently rung session (rings.py), so
    # concurrent publishers rotate over the pool.
    last_doorbell_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # Used by sweeps.expire_idle_sessions: live sessions by idleness.
            models.Index(
                fields=["last_seen_at"], name="mcp_session_live_idle",
                condition=Q(terminated_at__isnull=True),
            ),
            # Live sessions of a credential, least recently seen first: initialize evicts
            # beyond the per-credential cap (transitions.evict_sessions_over_cap).
            models.Index(
                fields=["credential", "last_seen_at"], name="mcp_session_live_by_cred",
                condition=Q(terminated_at__isnull=True),
            ),
            # sessions.transitions.delete_ended_sessions (the retention prune): ended sessions
            # past their day of retention.
            models.Index(
                fields=["terminated_at"], name="mcp_session_prune",
                condition=Q(terminated_at__isnull=False),
            ),
            # Attached sessions of an endpoint (the doorbell's pool).
            models.Index(
                fields=["endpoint", "last_seen_at"], name="mcp_session_live_by_endpoint",
                condition=Q(terminated_at__isnull=True),
            ),
        ]

    def __str__(self):
        return f"{self.id[:8]}… ({self.endpoint_id})"

    @property
    def live(self) -> bool:
        return self.terminated_at is None


def mint_host_id() -> str:
    return secrets.token_hex(16)


class StreamHost(models.Model):
    """One web process that holds MCP notification streams, and its lease.

    An idle stream writes nothing: the process renews this one row every
    ``queries.stream_lease_renew()`` for all the streams it holds, and the streams count as
    open while ``lease_until`` is in the future. A process killed without a goodbye stops
    renewing, so its streams stop counting within ``queries.stream_lease()``; the idle-session
    sweep then deletes the row with its attachments (``transitions.reset_stale_stream_counts``).
    """

    id = models.CharField(primary_key=True, max_length=32, default=mint_host_id, editable=False)
    started_at = models.DateTimeField()
    lease_until = models.DateTimeField(db_index=True)

    def __str__(self):
        return f"stream host {self.id[:8]}… until {self.lease_until:%H:%M:%S}"


class StreamAttachment(models.Model):
    """One open notification stream: which session, held by which process. Inserted when the
    stream opens and deleted when it closes (in the same transaction as the session's
    ``open_streams`` count); a crashed process's rows go with its ``StreamHost``. The retention
    sweep leaves a session alone while any attachment still names it."""

    session = models.ForeignKey(McpSession, on_delete=models.CASCADE,
                                related_name="stream_attachments")
    host = models.ForeignKey(StreamHost, on_delete=models.CASCADE, related_name="attachments")
    opened_at = models.DateTimeField()

    def __str__(self):
        return f"{self.session_id[:8]}… on {self.host_id[:8]}…"
