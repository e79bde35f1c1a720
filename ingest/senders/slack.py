"""Slack's Events API: a v0 HMAC-SHA256 of "v0:<timestamp>:<body>" in X-Slack-Signature within
the timestamp window, keyed by the app's Signing Secret; the url_verification handshake; the
event_id in the body, kept across Slack's retries; the message's author as the actor, a bot's
own message taken only where a route lists the bot (docs/senders.md#slack-events-api); and the
client of its connection, a bot token (docs/write-back.md#slack)."""

import hashlib
import re
from urllib.parse import urlsplit

from switchboard import harness_text

from . import (ConnectionSpec, Identity, Sender, WriteBackClient, checked_page,
               send_living_status)
from .. import outbound
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
    message's; a thread's notice has none); Slack has no roles. A message written by a bot or
    an app (a ``bot_id``, or ``subtype: bot_message``) has the bot id as its login and is a
    bot's actor."""
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


# -- the connection's client (docs/write-back.md#slack) ---------------------------------------
#
# Requests go through ingest/outbound.py with httpx, not through slack_sdk's WebClient: the
# WebClient opens URLs with urllib, which follows a redirect to any host, retries on its own and
# waits 30 s, where every write-back keeps to the connection's api_url, a 10 s timeout and one
# retry policy (the outbox's). slack_sdk is the tests' judge of each request instead
# (ingest/tests/slack_standin.py): each call below is sent as its WebClient method sends it,
# POST with a form body, or JSON for the chat.* methods.

DEFAULT_API_URL = "https://slack.com/api"
# Slack answers HTTP 200 with {"ok": false, "error": …}: these errors are the connection's own
# (as a 401 is elsewhere), these may pass later; any other fails the write-back at once.
CREDENTIALS_REFUSED = frozenset({"invalid_auth", "not_authed", "token_revoked", "token_expired",
                                 "account_inactive", "no_permission", "missing_scope"})
RETRYABLE_ERRORS = frozenset({"internal_error", "fatal_error", "service_unavailable",
                              "request_timeout", "ratelimited"})
# The status reply carries this in its message metadata (Slack shows none of it), with the
# todo's id in the payload: how a send whose worker died after Slack took it is found again.
STATUS_EVENT_TYPE = "switchboard_status"
# How many replies a look for our status reads: one page of those posted since the write-back
# was made.
REPLY_LOOK_PAGE = 100
# Slack's ids (C…, G…, D… channels; U…, W…, B…, A…) and message timestamps ("1515449522.000016").
_CHANNEL_RE = re.compile(r"[CDG][A-Z0-9]{2,30}")
_ID_RE = re.compile(r"[A-Z][A-Z0-9]{2,30}")
_TS_RE = re.compile(r"[0-9]{1,12}\.[0-9]{1,6}")
_HOST_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,98}[a-z0-9])?")
# The message subtypes that are somebody's message to answer; others (a join, a topic change, a
# deletion) and a thread's notice have nothing to react to.
_ANSWERABLE_SUBTYPES = frozenset({None, "file_share", "thread_broadcast", "me_message",
                                  "bot_message", "message_changed"})
_JSON = {"Content-Type": "application/json; charset=utf-8"}


class SlackError(outbound.SourceError):
    """Slack's own ``{"ok": false}``: ``error`` is its code (``message_not_found``, …)."""

    def __init__(self, method: str, error: str):
        super().__init__(f"{method}: {error}", retryable=error in RETRYABLE_ERRORS,
                         credentials_refused=error in CREDENTIALS_REFUSED)
        self.error = error


def check_bot_token(token: str) -> None:
    """ValueError unless ``token`` is a bot token (``xoxb-…``): a user token would write as a
    person, and an app-level token (``xapp-…``) cannot call these methods."""
    if not token.startswith("xoxb-") or len(token) > 500 or any(
            ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError("a Slack bot token, xoxb-… (the app's OAuth & Permissions page: Bot "
                         "User OAuth Token); not a user (xoxp-) or app-level (xapp-) token")


def channel_id(value) -> str:
    """A channel id taken from a payload (C…, G…, D…); else SourceError."""
    if not isinstance(value, str) or not _CHANNEL_RE.fullmatch(value):
        raise outbound.SourceError(f"not a channel switchboard writes to: {str(value)[:40]!r}")
    return value


def message_ts(value) -> str:
    """A message's timestamp taken from a payload ("1515449522.000016"); else SourceError."""
    if not isinstance(value, str) or not _TS_RE.fullmatch(value):
        raise outbound.SourceError(f"not a message timestamp: {str(value)[:40]!r}")
    return value


def call(connection, method: str, now, *, json=None, form=None) -> dict:
    """One Web API ``method`` under the connection's bot token; its answer when ``ok``, else
    ``SlackError`` (an HTTP failure is outbound's SourceError, a 429 waiting its Retry-After)."""
    answer = outbound.send(connection.api_url, "POST", f"/{method}", token=connection.secret,
                           json=json, form=form, headers=_JSON if json is not None else None,
                           now=now)
    body = dict_of(answer.body)
    if body.get("ok") is not True:
        raise SlackError(method, text_of(body.get("error")) or "an answer without ok")
    return body


def connection_ids(connection) -> dict:
    """What ``identify`` recorded in the connection's ``identity_id``: the bot's user id, its
    bot id, its app id and the workspace's web host, each "" when unknown."""
    parts = (connection.identity_id or "").split("/", 3)
    return dict(zip(("user_id", "bot_id", "app_id", "host"), parts + [""] * (4 - len(parts))))


def identify(connection, now) -> Identity:
    """``auth.test``: the bot user's name, and as its id "user/bot/app/host" (the bot's user
    id, bot id, app id when Slack says it, and the workspace's host from its ``url``, for the
    thread's link): the loop guard and ``target_url`` read them back (``connection_ids``)."""
    body = call(connection, "auth.test", now)
    user, user_id, bot_id = (text_of(body.get(key)) for key in ("user", "user_id", "bot_id"))
    if not (user and _ID_RE.fullmatch(user_id) and _ID_RE.fullmatch(bot_id)):
        raise outbound.SourceError("auth.test did not answer with a bot's user and bot_id: is "
                                   "the token the app's bot token?")
    app_id = text_of(body.get("app_id"))
    app_id = app_id if _ID_RE.fullmatch(app_id) else ""
    url = urlsplit(text_of(body.get("url")))
    host = (url.hostname or "") if url.scheme == "https" else ""
    ids = "/".join((user_id, bot_id, app_id))
    # identity_id holds 64 characters; a workspace host that does not fit leaves the thread
    # without a link rather than the loop guard without an id.
    if _HOST_RE.fullmatch(host) and len(ids) + 1 + len(host) <= 64:
        ids += "/" + host
    return Identity(login=user, id=ids)


def find_target(kind: str, payload: dict):
    """The message a delivery is about and its thread: ``({"channel", "ts", "thread_ts"},
    "C…: message TS")``, ``thread_ts`` the thread's first message (the message itself when it
    starts none); None for an event with no message to answer (a reaction, a join, a
    deletion, a thread's notice) or ids that do not pass the checks."""
    if payload.get("type") != "event_callback":
        return None
    event = dict_of(payload.get("event"))
    subtype = event.get("subtype")
    if (event.get("type") not in ("message", "app_mention") or is_thread_notice(event)
            or not (subtype is None or isinstance(subtype, str))
            or subtype not in _ANSWERABLE_SUBTYPES):
        return None
    message = _message(event)
    try:
        channel = channel_id(event.get("channel") or message.get("channel"))
        ts = message_ts(message.get("ts"))
        root = message_ts(message.get("thread_ts") or ts)
    except outbound.SourceError:
        return None
    return {"channel": channel, "ts": ts, "thread_ts": root}, f"{channel}: message {ts}"


def send_ack(connection, target, now) -> str:
    """``reactions.add`` ``eyes`` on the message; one already there (``already_reacted``: a
    send repeated after its worker died) is the same ack. A reaction has no id of its own."""
    try:
        call(connection, "reactions.add", now, form={
            "channel": channel_id(target["channel"]), "name": "eyes",
            "timestamp": message_ts(target["ts"])})
    except SlackError as refused:
        if refused.error != "already_reacted":
            raise
    return ""


def send_status(connection, target, update, external_id: str, now, look_since) -> str:
    """The living status: one reply in the message's thread, ``external_id`` its ``ts``,
    edited with ``chat.update``; posted with ``chat.postMessage`` the first time, and again
    when someone deleted it. With ``look_since``, an earlier send may have posted it: the
    thread's replies since then are read for ours first."""
    channel, root = channel_id(target["channel"]), message_ts(target["thread_ts"])
    message = {"channel": channel, "text": update.text,
               "metadata": {"event_type": STATUS_EVENT_TYPE,
                            "event_payload": {"todo_id": update.todo_id}}}
    return send_living_status(
        external_id, look_since,
        look=lambda: _find_own_reply(connection, channel, root, update.todo_id, look_since, now),
        edit=lambda found: call(connection, "chat.update", now,
                                json={**message, "ts": message_ts(found)}),
        post=lambda: call(connection, "chat.postMessage", now, json={
            **message, "thread_ts": root, "unfurl_links": False, "unfurl_media": False}),
        posted_id=lambda body: message_ts(body.get("ts")),
        gone=lambda refused: getattr(refused, "error", "") == "message_not_found")


def _find_own_reply(connection, channel, root, todo_id, since, now) -> str:
    # Only replies posted since the write-back was made: one page holds them, however long the
    # thread. Ours is the bot's, with the todo's id in its metadata.
    body = call(connection, "conversations.replies", now, form={
        "channel": channel, "ts": root, "oldest": f"{since.timestamp():.6f}",
        "limit": str(REPLY_LOOK_PAGE), "include_all_metadata": "1"})
    ids = connection_ids(connection)
    for reply in body.get("messages") if isinstance(body.get("messages"), list) else []:
        reply = dict_of(reply)
        metadata = dict_of(reply.get("metadata"))
        if (metadata.get("event_type") == STATUS_EVENT_TYPE
                and dict_of(metadata.get("event_payload")).get("todo_id") == todo_id
                and text_of(reply.get("bot_id")) == ids["bot_id"]):
            return text_of(reply.get("ts"))
    return ""


def target_url(connection, target) -> str:
    """The thread on Slack's web pages (``https://<workspace host>/archives/C…/p<ts>``), the
    host as ``auth.test`` named it; "" before a test recorded one."""
    host = connection_ids(connection)["host"]
    if not _HOST_RE.fullmatch(host):
        return ""
    return checked_page(lambda: (f"https://{host}/archives/{channel_id(target.get('channel'))}/"
                                 f"p{message_ts(target.get('thread_ts')).replace('.', '')}"))


def is_own_write_back(connection, kind: str, payload: dict) -> bool:
    """The event's message (an edit's new version, a deletion's old one) was written by the
    connection's bot (its ``bot_id``, ``app_id``, ``bot_profile``, or its ``user`` the bot's
    user), or the event's ``user`` is the bot's (its own ``eyes`` in ``reaction_added``)."""
    ids = connection_ids(connection)
    event = dict_of(payload.get("event"))
    if is_thread_notice(event):
        return False
    for said in (event, _message(event)):
        profile = dict_of(said.get("bot_profile"))
        for value, own in ((said.get("bot_id"), ids["bot_id"]),
                           (profile.get("id"), ids["bot_id"]),
                           (said.get("user"), ids["user_id"]),
                           (said.get("app_id"), ids["app_id"]),
                           (profile.get("app_id"), ids["app_id"])):
            if own and text_of(value) == own:
                return True
    return False


def thread_key(kind: str, payload: dict) -> str:
    """``<channel>:<thread_ts or ts>``: the thread a message is in, or the message that may
    start one (an edit's or a deletion's message; a reaction's item)."""
    event = dict_of(payload.get("event"))
    message, item = _message(event), dict_of(event.get("item"))
    channel = first(event.get("channel"), message.get("channel"), item.get("channel"))
    ts = first(message.get("thread_ts"), event.get("thread_ts"), message.get("ts"),
               item.get("ts"))
    return f"{channel}:{ts}" if channel and ts else ""


SENDER = Sender(
    source=Source.SLACK, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, reads_every_actor=True,
    mints_own_secret=True, delivery_id=delivery_id, is_handshake=is_handshake,
    handshake_kind="url_verification", retry_note=retry_note,
    opt_in_kinds=frozenset({THREAD_NOTICE_KIND}),
    kind_origin="the event's type (or the payload's type)",
    connections=(ConnectionSpec(kind="slack", default_api_url=DEFAULT_API_URL, identify=identify,
                                check_secret=check_bot_token),),
    write_back=WriteBackClient(find_target=find_target, ack=send_ack, status=send_status,
                               markup="slack", target_url=target_url, max_status_chars=3000),
    is_own_write_back=is_own_write_back, thread_key=thread_key)
