"""Who triggered a delivery, and whether a route lets them hand it work
(docs/work-control.md#who-may-trigger-work). Each sender that names an actor reads it in its
``read_actor`` (``ingest/senders/``): GitHub, Gitea, GitLab and Slack.

A route may name trusted logins (``actors``) and/or trusted roles (``author_associations``,
GitHub's names); a delivery qualifies when its actor's login is listed OR its role is. Only
what the signed payload itself says counts, and where it does not say, nobody qualifies by
role (the route fails closed; a listed login still does). A message written by a bot or an
app (Slack) is a *bot's* actor: no route takes work from one unless its ``actors`` list that
bot id, rules or not; an agent that answers in the channel it listens to would otherwise make
a todo of its own reply, and of the reply to that.
"""

from dataclasses import dataclass

# GitHub's author_association values, the vocabulary of a route's trusted roles.
AUTHOR_ASSOCIATIONS = ("OWNER", "MEMBER", "COLLABORATOR", "CONTRIBUTOR",
                       "FIRST_TIME_CONTRIBUTOR", "FIRST_TIMER", "MANNEQUIN", "NONE")


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


def dict_of(value) -> dict:
    return value if isinstance(value, dict) else {}


def text_of(value) -> str:
    return value if isinstance(value, str) else ""


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
