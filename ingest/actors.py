"""Who triggered a delivery, per source, and whether a route lets them hand it work
(docs/work-control.md#who-may-trigger-work).

A route may name trusted logins (``actors``) and/or trusted roles (``author_associations``,
GitHub's names); a delivery qualifies when its actor's login is listed OR its role is. Only
what the signed payload itself says counts, and where it does not say, nobody qualifies by
role (the route fails closed; a listed login still does).

* GitHub: the actor is ``sender.login``. Its role is the ``author_association`` of the object
  the event is about — the comment, review, pull request or issue, the first the payload
  carries — but only when the sender wrote that object: on ``issues.labeled`` by a
  maintainer, the issue's association is the issue author's, not the labeller's, so the
  labeller qualifies by login only.
* Gitea / Forgejo: the actor is ``sender.login``; payloads carry no author_association, but
  ``repository.permissions`` (``admin``, ``push``, ``pull``). Gitea fills it with the sender's
  permission on comments and on opening an issue or pull request (the sender is the poster),
  and with the issue poster's or a fixed owner's on other events, so it counts only for
  ``issue_comment.*``, ``issues.opened`` and ``pull_request.opened``: ``admin`` as OWNER,
  ``push`` as COLLABORATOR (MEMBER is never derived).
* GitLab: the actor is ``user.username`` (``user_username`` on push events). GitLab payloads
  carry no role at all, so a GitLab route can trust logins only (add_webhook_route refuses
  ``author_associations`` there).
* Slack: the actor is the user id of the event's message (``event.user``; for an edit or a
  deletion, the edited or deleted message's). A thread's notice of a reply (kind
  ``message.thread_notice``) carries the thread's first message but is nobody's: no actor,
  so it passes no actor rule. Slack has no roles. A message written by a bot
  or an app (a ``bot_id``, or ``subtype: bot_message``) has the bot id as its login and is a
  *bot's* actor: no route takes work from one unless its ``actors`` list that bot id, rules or
  not. An agent that answers in the channel it listens to would otherwise make a todo of its
  own reply, and of the reply to that; an alerting bot whose posts are work is listed by id.
"""

from dataclasses import dataclass

from . import titles
from .models import Source

# GitHub's author_association values, the vocabulary of a route's trusted roles.
AUTHOR_ASSOCIATIONS = ("OWNER", "MEMBER", "COLLABORATOR", "CONTRIBUTOR",
                       "FIRST_TIME_CONTRIBUTOR", "FIRST_TIMER", "MANNEQUIN", "NONE")
# Sources whose payloads name an actor switchboard reads.
ACTOR_SOURCES = (Source.GITHUB, Source.GITEA, Source.GITLAB, Source.SLACK)
# Sources whose payloads say something about the actor's role.
ASSOCIATION_SOURCES = (Source.GITHUB, Source.GITEA)

# Where a GitHub payload keeps the object the event is about, most specific first.
_GITHUB_SUBJECTS = ("comment", "review", "pull_request", "issue", "discussion")
# Gitea event kinds whose repository.permissions are the sender's own.
_GITEA_SENDER_PERMISSION_KINDS = ("issue_comment", "issues.opened", "pull_request.opened")


@dataclass(frozen=True)
class Actor:
    login: str  # "" when the payload names none
    associations: frozenset = frozenset()
    bot: bool = False  # a bot's or app's own message (Slack): taken only where listed

    def describe(self) -> str:
        if self.bot:
            return f"{self.login or 'a bot'} (a bot's message)"
        role = "/".join(sorted(self.associations)) or "no role"
        return f"{self.login or 'no actor'} ({role})"


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _github(kind: str, payload: dict) -> Actor:
    login = _text(_dict(payload.get("sender")).get("login"))
    for key in _GITHUB_SUBJECTS:
        subject = _dict(payload.get(key))
        if subject:
            author = _text(_dict(subject.get("user")).get("login"))
            association = _text(subject.get("author_association"))
            if login and author.lower() == login.lower() and association:
                return Actor(login, frozenset({association.upper()}))
            break
    return Actor(login)


def _gitea(kind: str, payload: dict) -> Actor:
    sender = _dict(payload.get("sender"))
    login = _text(sender.get("login")) or _text(sender.get("username"))
    if not (kind.startswith("issue_comment") or kind in _GITEA_SENDER_PERMISSION_KINDS):
        return Actor(login)
    permissions = _dict(_dict(payload.get("repository")).get("permissions"))
    if permissions.get("admin") is True:
        return Actor(login, frozenset({"OWNER"}))
    if permissions.get("push") is True:
        return Actor(login, frozenset({"COLLABORATOR"}))
    return Actor(login)


def _gitlab(kind: str, payload: dict) -> Actor:
    login = _text(_dict(payload.get("user")).get("username")) or _text(payload.get("user_username"))
    return Actor(login)


def _slack_message(event: dict) -> dict:
    """The message a Slack event is about: the deleted one (``message_deleted``:
    ``previous_message``), the nested ``message`` of an event that has no author of its own
    (an edit, ``message_changed``), else the event itself. A thread's notices carry the
    thread's first message too, but are nobody's (``titles.is_slack_thread_notice``)."""
    if event.get("subtype") == "message_deleted":
        return _dict(event.get("previous_message"))
    nested = _dict(event.get("message"))
    if nested and not (_text(event.get("user")) or _text(event.get("bot_id"))):
        return nested
    return event


def _slack(kind: str, payload: dict) -> Actor:
    event = _dict(payload.get("event"))
    if titles.is_slack_thread_notice(event):
        # The message it carries is the thread's first, not a new one by that author: a
        # notice is nobody's, and passes no route's actor rule.
        return Actor("")
    message = _slack_message(event)
    bot_id = _text(message.get("bot_id")) or _text(event.get("bot_id"))
    if bot_id or "bot_message" in (message.get("subtype"), event.get("subtype")):
        return Actor(bot_id, bot=True)
    return Actor(_text(message.get("user")) or _text(event.get("user")))


_READERS = {Source.GITHUB: _github, Source.GITEA: _gitea, Source.GITLAB: _gitlab,
            Source.SLACK: _slack}
# Sources whose deliveries are read for their actor on every route, rules or not: a bot's
# message is taken only where a route lists it.
BOT_SOURCES = (Source.SLACK,)


def event_actor(source: str, kind: str, payload) -> Actor:
    """The actor of a delivery from ``source`` as its payload names them."""
    reader = _READERS.get(source)
    if reader is None or not isinstance(payload, dict):
        return Actor("")
    return reader(kind or "", payload)


def filters_actors(route) -> bool:
    return bool(route.actors or route.author_associations)


def admits(route, actor: Actor) -> bool:
    """Whether ``route`` takes work from ``actor``: a bot's message only when its id is
    listed; anyone else always without actor rules, else when the login is listed
    (case-insensitively, as GitHub, Gitea and GitLab compare logins) or one of the actor's
    roles is."""
    listed = bool(actor.login) and actor.login.lower() in {login.lower()
                                                           for login in route.actors}
    if actor.bot or listed:
        return listed
    if not filters_actors(route):
        return True
    return bool(actor.associations & set(route.author_associations))


def normalized_actor_rules(source: str, actors, associations) -> tuple[list, list]:
    """``(actors, author_associations)`` as a route stores them (logins stripped, roles upper
    case, each once), or ValueError naming the field: a role outside AUTHOR_ASSOCIATIONS, a
    login with spaces, a source whose payloads name no actor (or, for roles, no role)."""
    for field, values in (("actors", actors), ("author_associations", associations)):
        if values is not None and (not isinstance(values, (list, tuple))
                                   or not all(isinstance(value, str) for value in values)):
            raise ValueError(f"{field}: a list of names")
    logins = sorted({login.strip() for login in actors or [] if login.strip()}, key=str.lower)
    roles = sorted({role.strip().upper() for role in associations or [] if role.strip()})
    if (logins or roles) and source not in ACTOR_SOURCES:
        raise ValueError(f"actors: {source} payloads name no actor switchboard reads; only "
                         f"{', '.join(ACTOR_SOURCES)} routes can trust actors")
    bad = [login for login in logins if any(c.isspace() for c in login) or len(login) > 100]
    if bad:
        raise ValueError(f"actors: not logins: {bad}")
    unknown = [role for role in roles if role not in AUTHOR_ASSOCIATIONS]
    if unknown:
        raise ValueError(f"author_associations: unknown {unknown}; one of "
                         f"{', '.join(AUTHOR_ASSOCIATIONS)}")
    if roles and source not in ASSOCIATION_SOURCES:
        raise ValueError(f"author_associations: {source} payloads carry no role; trust logins "
                         "with actors instead")
    return logins, roles
