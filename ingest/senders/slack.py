"""Slack's Events API: a v0 HMAC-SHA256 of "v0:<timestamp>:<body>" in X-Slack-Signature within
the timestamp window, keyed by the app's Signing Secret; the url_verification handshake; the
event_id in the body, kept across Slack's retries; the message's author as the actor, a bot's
own message taken only where a route lists the bot (docs/senders.md#slack-events-api)."""

import hashlib
import re

from switchboard import harness_text

from . import ConnectionSpec, Sender
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..problems import one_line
from ..titles import dig, first, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            check_timestamp, hmac_hex, matches_any, require_header)

# A message's text is one part of a one-line title: enough to tell what was asked.
MAX_TEXT_CHARS = 200
# Slack's markup: <@U123>, <@U123|ana>, <#C123|general>, <!here>, <!subteam^S1|@team>,
# <https://x|label>, <https://x>. Rendered as the text a reader of the channel saw.
_MARKUP_RE = re.compile(r"<([^<>]*)>")
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))
# Slack's notice that a thread changed (a reply was posted): a message event with no author of
# its own, carrying the thread's first message. It is nobody's new message, so it has a kind of
# its own, which only a route naming it exactly takes.
THREAD_NOTICE_KIND = "message.thread_notice"
# What Slack updates on a thread's first message when somebody replies to it.
_REPLY_METADATA = frozenset({"reply_count", "reply_users", "reply_users_count", "latest_reply",
                             "replies", "subscribed", "last_read", "thread_ts", "is_locked"})


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "X-Slack-Signature")
    stamp_header = require_header(headers, "X-Slack-Request-Timestamp")
    version, _, signature = given.partition("=")
    if version != "v0" or not signature:
        raise VerificationFailed("X-Slack-Signature is not v0=<hex>")
    check_timestamp(stamp_header, now)
    # Signed as sent: "v0:<timestamp header>:<raw body>".
    signed = b"v0:" + as_bytes(stamp_header) + b":" + body
    expected = [hmac_hex(secret, signed) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(signature.lower())]):
        raise VerificationFailed("signature mismatch")
    # The delivery id (event_id) is in the body; a retry re-signs with a fresh timestamp.
    return Envelope(TrustMode.SIGNED, "", "", hashlib.sha256(signed).hexdigest())


def _without_reply_metadata(message: dict) -> dict:
    return {key: value for key, value in message.items() if key not in _REPLY_METADATA}


def is_thread_notice(event) -> bool:
    """A ``message`` event without an author of its own that only reports on a thread:
    ``message_replied``, a ``hidden`` notice without a subtype, or a ``message_changed`` whose
    message differs from its previous version in reply metadata alone. An edit (its text or
    files changed) and a deletion are not notices: they are about their author's message."""
    if not isinstance(event, dict) or event.get("type") != "message":
        return False
    if text_of(event.get("user")) or text_of(event.get("bot_id")):
        return False
    subtype = event.get("subtype")
    if subtype == "message_replied":
        return True
    if subtype == "message_changed":
        after, before = event.get("message"), event.get("previous_message")
        return (isinstance(after, dict) and isinstance(before, dict)
                and _without_reply_metadata(after) == _without_reply_metadata(before))
    return subtype is None and event.get("hidden") is True


def derive_kind(event: str, payload) -> str:
    # The inner event's type (app_mention, message); an envelope without one
    # (url_verification, app_rate_limited) is kinded by its own type.
    if not isinstance(payload, dict):
        return ""
    kind = text(dig(payload, "event", "type")) if payload.get("type") == "event_callback" else ""
    kind = kind or text(payload.get("type"))
    if kind == "message" and is_thread_notice(payload.get("event")):
        kind = THREAD_NOTICE_KIND
    return kind


def _markup(match) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    if target.startswith("@"):
        return f"@{label or target[1:]}"
    if target.startswith("#"):
        return f"#{label or target[1:]}"
    if target.startswith("!"):
        return label if label.startswith("@") else f"@{label or target[1:].split('^')[0]}"
    return label or target


def slack_text(value) -> str:
    """A message's text as its reader saw it — mentions, channels and links as plain words,
    entities decoded — then sanitised as doorbells are (one line, no control or format
    characters, no angle brackets) and cut to MAX_TEXT_CHARS."""
    value = _MARKUP_RE.sub(_markup, text(value))
    for entity, char in _ENTITIES:
        value = value.replace(entity, char)
    value = harness_text.sanitize_content(value)
    return value if len(value) <= MAX_TEXT_CHARS else value[:MAX_TEXT_CHARS - 1] + "…"


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    event = dict_of(payload.get("event"))
    channel = first(event.get("channel"), dig(event, "item", "channel"))
    user = first(event.get("user"), event.get("username"), event.get("bot_id"))
    where = f"#{channel}" if channel else "Slack"
    who = f" @{user}" if user else ""
    return f"{where}{who}: {slack_text(event.get('text')) or kind or 'event'}"


def _message(event: dict) -> dict:
    """The message an event is about: the deleted one (``message_deleted``:
    ``previous_message``), the nested ``message`` of an event that has no author of its own
    (an edit, ``message_changed``), else the event itself. A thread's notices carry the
    thread's first message too, but are nobody's (``is_thread_notice``)."""
    if event.get("subtype") == "message_deleted":
        return dict_of(event.get("previous_message"))
    nested = dict_of(event.get("message"))
    if nested and not (text_of(event.get("user")) or text_of(event.get("bot_id"))):
        return nested
    return event


def read_actor(kind: str, payload: dict) -> Actor:
    """The user id of the event's message (for an edit or a deletion, the edited or deleted
    message's; a thread's notice has none); Slack has no roles. A message written by a bot or an app (a ``bot_id``, or
    ``subtype: bot_message``) has the bot id as its login and is a bot's actor."""
    event = dict_of(payload.get("event"))
    if is_thread_notice(event):
        # The message it carries is the thread's first, not a new one by that author: a
        # notice is nobody's, and passes no route's actor rule.
        return Actor("")
    message = _message(event)
    bot_id = text_of(message.get("bot_id")) or text_of(event.get("bot_id"))
    if bot_id or "bot_message" in (message.get("subtype"), event.get("subtype")):
        return Actor(bot_id, bot=True)
    return Actor(text_of(message.get("user")) or text_of(event.get("user")))


def delivery_id(envelope: Envelope, payload: dict) -> str:
    # Slack's retries (X-Slack-Retry-Num) keep the event_id: they fold into the live todo.
    return payload.get("event_id") if isinstance(payload.get("event_id"), str) else ""


def is_handshake(payload: dict) -> bool:
    """Slack's url_verification, sent when an Events API request URL is saved."""
    return payload.get("type") == "url_verification"


def retry_note(header) -> str:
    """Slack says when a request is its retry of an unanswered one: kept in the delivery log.
    ``header`` reads one request header (None when absent)."""
    if not header("x-slack-retry-num"):
        return ""
    reason = one_line(header("x-slack-retry-reason") or "", 40)
    return (f"slack retry {one_line(header('x-slack-retry-num'), 8)}"
            + (f" ({reason})" if reason else ""))


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "api.slack.com/apps → your app → Basic Information → App Credentials → "
        "Signing Secret: the one add_webhook … --secret took; when Slack regenerates it, "
        f"paste the new one: manage.py rotate_webhook_secret {slug} --secret ….",
        f"Event Subscriptions → Enable → Request URL: {hook_url} (switchboard answers "
        "Slack's url_verification, and Slack shows “Verified”).",
        "Subscribe to the bot events you route and reinstall the app.",
    ]


SENDER = Sender(
    source=Source.SLACK, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, reads_every_actor=True,
    mints_own_secret=True, delivery_id=delivery_id, is_handshake=is_handshake,
    handshake_kind="url_verification", retry_note=retry_note,
    opt_in_kinds=frozenset({THREAD_NOTICE_KIND}),
    kind_origin="the event's type (or the payload's type)",
    # A bot token (xoxb-…); no write-back client yet.
    connections=(ConnectionSpec(kind="slack", default_api_url="https://slack.com/api"),))
