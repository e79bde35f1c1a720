"""Every sender switchboard verifies, one module each, in one registry
(docs/senders.md#adding-a-sender).

A sender is one ``Sender``: how its deliveries are verified, what kind and title they get,
who they say triggered them, what its secrets look like, which of its requests are
handshakes or retries, and the steps that point it here. The hook, the transitions, the
console and the commands ask the registry (``get_sender``) and name no source themselves.
"""

import secrets
from dataclasses import dataclass
from typing import Callable

from .. import outbound
from ..actors import AUTHOR_ASSOCIATIONS, Actor, dict_of, text_of
from ..titles import clean_kind
from ..verification import Envelope, VerificationFailed, accepted_secrets


def _opaque_secret() -> str:
    return secrets.token_urlsafe(32)


def _secret_fits(secret: str) -> None:
    pass


def _headers_delivery_id(envelope: Envelope, payload: dict) -> str:
    return envelope.delivery_id


@dataclass(frozen=True)
class Identity:
    """Who a source says a connection is: its login (``<slug>[bot]`` for a GitHub App) and
    id (the App's or the user's), as text."""

    login: str
    id: str


@dataclass(frozen=True)
class ConnectionSpec:
    """One kind of connection (docs/write-back.md#connections): switchboard's outbound
    identity at a sender's system, with its client in the sender's module."""

    kind: str  # the ConnectionKind value connections store
    default_api_url: str  # "" when every connection must name its own (Gitea, Forgejo)
    # (connection, now) -> Identity, or outbound.SourceError. None: no client yet, so such a
    # connection cannot be made.
    identify: Callable | None = None
    check_secret: Callable = _secret_fits  # (secret) -> None, or ValueError
    needs_app_id: bool = False  # a GitHub App: the App's id beside its private key


@dataclass(frozen=True)
class WriteBackClient:
    """How switchboard writes back to a sender's system (docs/write-back.md#what-is-written-back).
    Every call takes the connection and the target ``find_target`` read from the delivery's
    payload, and raises ``outbound.SourceError`` when the source says no."""

    # (kind, payload) -> (target dict, label for people), or None: nothing to write back on.
    find_target: Callable
    # (connection, target, now) -> the reaction's id, as text; the target also names its
    # ``todo_id`` (Linear's thought links the todo's page).
    ack: Callable
    # (connection, target, update, external_id, now, look_since) -> the status's id, where
    # ``update`` is a ``status_text.StatusUpdate`` in this client's markup: edited in place
    # when ``external_id`` is given; with ``look_since`` (a time), an earlier send may have
    # posted it before its worker died, so look for it before posting.
    status: Callable
    markup: str = "markdown"  # a key of status_text.MARKUPS: "markdown" or "slack"
    # (connection, target) -> the web page people open for the target (the issue, the comment,
    # the thread), built from the connection's api_url and the target's checked segments only,
    # never from a URL in a payload; "" when there is none to link.
    target_url: Callable | None = None
    max_status_chars: int = 4000  # the status's cap: 4,000 on the forges, Slack 3,000, Linear 2,000
    # (connection, target, update, external_id, now, look_since) -> the check run's id, as
    # ``status`` does; None: this source has no check runs.
    check_run: Callable | None = None
    wants_check_run: Callable | None = None  # (connection, target) -> True: write a check run


def _answer_id(answer) -> str:
    return str(dict_of(answer.body).get("id", ""))


def _is_404(failed: outbound.SourceError) -> bool:
    return failed.status == 404


def send_living_status(external_id: str, look_since, *, look, edit, post,
                       posted_id=_answer_id, gone=_is_404) -> str:
    """The flow every source's living status follows (docs/write-back.md#the-living-status):
    with no id yet but ``look_since``, an earlier send may have posted it before its worker
    died, so ``look()`` for its marker first (its id, or ""); then ``edit(id)`` in place, and
    ``post()`` when there is none or someone deleted it (``gone(the SourceError)``: a 404 on
    the forges). ``posted_id(what post returned)`` is the new status's id (the ``id`` of the
    forges' answer). Returns the status's id."""
    if not external_id and look_since is not None:
        external_id = look()
    if external_id:
        try:
            edit(external_id)
            return external_id
        except outbound.SourceError as failed:
            if not gone(failed):
                raise
    return posted_id(post())


def checked_page(build_page: Callable, anchor_prefix: str = "", anchor=None) -> str:
    """A write-back target's web page: ``build_page()`` (from checked segments only), then
    ``#<anchor_prefix><anchor>`` when there is an anchor (a comment's or note's id); "" when a
    segment is missing or does not pass ``outbound``'s checks."""
    try:
        url = build_page()
        if anchor:
            url += f"#{anchor_prefix}{outbound.number_segment(anchor)}"
    except (KeyError, outbound.SourceError):
        return ""
    return url


def is_connection_identity(connection, login: str, user_id=None) -> bool:
    """The loop guard's test of a delivery's actor: ``login`` is the connection's identity
    (case does not matter to the forges), or ``user_id`` its id (which a renamed bot user
    keeps)."""
    if login and connection.identity and login.lower() == connection.identity.lower():
        return True
    return (user_id is not None and bool(connection.identity_id)
            and str(user_id) == connection.identity_id)


def find_marked(items, marker: str, identity: str, *, body_key: str, author_of) -> str:
    """The id of the first of ``items`` (a source's list of comments or notes) whose text
    (``body_key``) holds ``marker`` and whose author (``author_of(item)``) is the connection's
    ``identity`` (anyone, while the connection has none recorded); "" when none does."""
    for item in items if isinstance(items, list) else []:
        item = dict_of(item)
        author = author_of(item)
        if marker in text_of(item.get(body_key)) and (
                not identity or author.lower() == identity.lower()):
            return str(item.get("id", ""))
    return ""


@dataclass(frozen=True)
class Sender:
    source: str  # the Source value webhooks store
    verify: Callable  # (webhook, headers, body, now) -> Envelope, or VerificationFailed
    derive_kind: Callable  # (event header, payload) -> kind, before clean_kind
    derive_title: Callable  # (kind, payload dict, webhook slug) -> one line
    setup_steps: Callable  # (hook URL, webhook slug) -> the steps, in order
    read_actor: Callable | None = None  # (kind, payload dict) -> Actor; None: names nobody
    reads_roles: bool = False  # its payloads say the actor's role (author_associations)
    reads_every_actor: bool = False  # read on every route: a bot's message goes where listed
    takes_forms: bool = False  # also posts x-www-form-urlencoded with a payload field
    # Redelivers under the delivery's own id with the same signed body (GitHub's and GitLab's
    # "Redeliver", Gitea's retries): a duplicate while its todo is live, new work once done.
    # The timestamped senders re-sign a retry, so there a repeat is only ever a replay.
    redelivers_under_its_id: bool = False
    signed: bool = True  # False: anyone with the URL may post (trust unverified)
    mints_own_secret: bool = False  # the sender mints the secret; switchboard is told it
    secret_example: str = "…"  # how its secret starts, for the commands' hints
    local_forwarder: str = ""  # a CLI that forwards to a loopback URL, when it has one
    mint_secret: Callable = _opaque_secret  # () -> a fresh secret switchboard shows once
    check_secret: Callable = _secret_fits  # (secret) -> None, or ValueError
    check_payload: Callable | None = None  # (payload, now): what it signs inside the body
    delivery_id: Callable = _headers_delivery_id  # (envelope, payload) -> its delivery id
    is_handshake: Callable | None = None  # (payload) -> True: echo its "challenge", no todo
    handshake_kind: str = ""  # the delivery log's kind for an answered handshake
    retry_note: Callable | None = None  # (header getter) -> "" or the log's note of a retry
    opt_in_kinds: frozenset = frozenset()  # kinds only a route naming them exactly takes
    event_headers: tuple = ()  # where its event name is, for refused deliveries' log
    kind_origin: str = "the payload's type"  # where its kind comes from, named in a bad_kind
    delivery_headers: tuple = ()  # where its delivery id is, likewise
    connections: tuple = ()  # the ConnectionSpecs a webhook of this source may write back with
    write_back: WriteBackClient | None = None  # None: nothing is written back (yet)
    # (connection, kind, payload) -> True when the connection itself caused the delivery (its
    # own comment): the loop guard. None: its deliveries are never its own.
    is_own_write_back: Callable | None = None
    # Threads (docs/work-control.md#threads): (kind, payload) -> the thread key, "" for none;
    # None: a source without threads. ends_thread: (kind, payload) -> True for a delivery
    # that ends its thread; stop_kinds names those for people.
    thread_key: Callable | None = None
    ends_thread: Callable | None = None
    stop_kinds: tuple = ()


from . import github, gitea, gitlab, stripe, standard, linear, slack, sentry, unsigned  # noqa: E402

SENDERS = {sender.source: sender for sender in (
    github.SENDER, gitea.SENDER, gitlab.SENDER, stripe.SENDER, standard.SENDER, linear.SENDER,
    slack.SENDER, sentry.SENDER, unsigned.SENDER)}
# Every header any sender names its event or delivery in (a refused delivery's log entry reads
# them before the webhook's sender is trusted with anything).
EVENT_HEADERS = tuple(dict.fromkeys(h for s in SENDERS.values() for h in s.event_headers))
DELIVERY_HEADERS = tuple(dict.fromkeys(h for s in SENDERS.values() for h in s.delivery_headers))
# Kinds a route takes only when it names them exactly (a Slack thread's notice).
OPT_IN_KINDS = frozenset(kind for s in SENDERS.values() for kind in s.opt_in_kinds)
# Every kind of connection, and the source whose webhooks it serves.
CONNECTION_SPECS = {spec.kind: spec for s in SENDERS.values() for spec in s.connections}
CONNECTION_SOURCE = {spec.kind: s.source for s in SENDERS.values() for spec in s.connections}


def get_connection_spec(kind: str) -> ConnectionSpec:
    """The spec of connection ``kind``; KeyError for a kind switchboard does not know."""
    return CONNECTION_SPECS[kind]


def get_sender(source: str) -> Sender:
    """The sender of ``source``; KeyError for a source switchboard does not know."""
    return SENDERS[source]


def verify_delivery(webhook, headers, body: bytes, *, now) -> Envelope:
    """Check ``body`` against the webhook's scheme and accepted secrets. Returns the envelope,
    or raises ``VerificationFailed``. A signed webhook without any secret verifies nothing."""
    sender = get_sender(webhook.source)
    if sender.signed and not accepted_secrets(webhook, now):
        raise VerificationFailed("webhook has no secret configured")
    return sender.verify(webhook, headers, body, now)


def check_payload(webhook, payload: dict, *, now) -> None:
    """The parsed body of a verified delivery against what its sender signs inside it (Linear's
    webhookTimestamp within 60 s). Raises ``VerificationFailed`` (``stale`` when it is old)."""
    check = get_sender(webhook.source).check_payload
    if check is not None:
        check(payload, now)


def derive_kind(source: str, event: str, payload) -> str:
    """The todo's kind: the sender's event name, ``.action`` appended where the payload has one
    (``issues.opened``), so routes can filter on either the event or the event and action."""
    return clean_kind(get_sender(source).derive_kind(event, payload))


def derive_title(source: str, kind: str, payload, *, webhook_slug: str) -> str:
    """One legible line for a todo created from this delivery."""
    payload = payload if isinstance(payload, dict) else {}
    return " ".join(get_sender(source).derive_title(kind, payload, webhook_slug).split())


def is_own_write_back(webhook, kind: str, payload) -> bool:
    """The loop guard (docs/write-back.md#the-loop-guard): the delivery's actor is the
    identity the webhook writes back under, so it reports switchboard's own write-back (its
    status comment, say) and must make no todo."""
    sender = get_sender(webhook.source)
    connection = webhook.connection if webhook.connection_id else None
    if connection is None or sender.is_own_write_back is None or not isinstance(payload, dict):
        return False
    return sender.is_own_write_back(connection, kind or "", payload)


def event_actor(source: str, kind: str, payload) -> Actor:
    """The actor of a delivery from ``source`` as its payload names them."""
    read = get_sender(source).read_actor
    if read is None or not isinstance(payload, dict):
        return Actor("")
    return read(kind or "", payload)


def normalized_actor_rules(source: str, actors, associations) -> tuple[list, list]:
    """``(actors, author_associations)`` as a route stores them (logins stripped, roles upper
    case, each once), or ValueError naming the field: a role outside AUTHOR_ASSOCIATIONS, a
    login with spaces, a sender whose payloads name no actor (or, for roles, no role)."""
    for field, values in (("actors", actors), ("author_associations", associations)):
        if values is not None and (not isinstance(values, (list, tuple))
                                   or not all(isinstance(value, str) for value in values)):
            raise ValueError(f"{field}: a list of names")
    logins = sorted({login.strip() for login in actors or [] if login.strip()}, key=str.lower)
    roles = sorted({role.strip().upper() for role in associations or [] if role.strip()})
    sender = get_sender(source)
    if (logins or roles) and sender.read_actor is None:
        naming = [s.source for s in SENDERS.values() if s.read_actor is not None]
        raise ValueError(f"actors: {source} payloads name no actor switchboard reads; only "
                         f"{', '.join(naming)} routes can trust actors")
    bad = [login for login in logins if any(c.isspace() for c in login) or len(login) > 100]
    if bad:
        raise ValueError(f"actors: not logins: {bad}")
    unknown = [role for role in roles if role not in AUTHOR_ASSOCIATIONS]
    if unknown:
        raise ValueError(f"author_associations: unknown {unknown}; one of "
                         f"{', '.join(AUTHOR_ASSOCIATIONS)}")
    if roles and not sender.reads_roles:
        raise ValueError(f"author_associations: {source} payloads carry no role; trust logins "
                         "with actors instead")
    return logins, roles
