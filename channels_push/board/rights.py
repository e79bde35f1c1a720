"""Who may watch the board: the viewer of a stream, re-checked against their Django session
and their account (docs/security.md#who-may-read-who-may-act), and the logout that reaches
their streams through their viewer group.

Visibility is checked per event: superusers see every endpoint, operators only endpoints they
own, judged by the endpoint's owner as read with the batch's rows (so an endpoint vended after
the stream opened is visible to its owner, and one given to another owner leaves the old
owner's stream with the next batch).
"""

import hashlib
from dataclasses import dataclass, field
from importlib import import_module

from django.conf import settings
from django.utils.crypto import constant_time_compare

from channels_push.bus import groups, publish


@dataclass
class Viewer:
    """Who is watching: what decides which rows their stream may carry. ``user``: the user as
    read with this viewer, for a stream whose right depends on more than the flag (a webhook
    page asks whether its webhook is still theirs)."""

    user_id: int
    superuser: bool
    user: object = field(default=None, compare=False, repr=False)

    def may_see(self, owner_id) -> bool:
        return self.superuser or owner_id == self.user_id


def find_viewer(user) -> Viewer:
    return Viewer(user_id=user.pk, superuser=user.is_superuser, user=user)


def _session_matches(data: dict | None, user) -> bool:
    """The Django session's data still carries ``user`` with their current password hash."""
    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY

    if not data:
        return False
    return str(data.get(SESSION_KEY)) == str(user.pk) and constant_time_compare(
        data.get(HASH_SESSION_KEY) or "", user.get_session_auth_hash())


def recheck_viewer(user_id: int, session_key: str | None, check_session: bool) -> Viewer | None:
    """One viewer's re-check: the viewer afresh (superuser flag re-read), or None
    when the stream must close: the user is gone or inactive, or (``check_session``) the Django
    session that opened the stream was logged out, expired, or no longer carries this user
    with their current password hash. ``recheck_viewers`` does the same for many at once."""
    return recheck_viewers([(user_id, session_key, check_session)])[(user_id, session_key,
                                                                       check_session)]


def _load_sessions(session_keys) -> dict:
    """``{session_key: data}`` of the live Django sessions among ``session_keys``: one query
    for a database-backed engine (the default), one load per key for any other."""
    from django.utils import timezone

    store_class = import_module(settings.SESSION_ENGINE).SessionStore
    if not session_keys:
        return {}
    if hasattr(store_class, "get_model_class"):
        rows = (store_class.get_model_class().objects
                .filter(session_key__in=session_keys, expire_date__gt=timezone.now())
                .values_list("session_key", "session_data"))
        return {key: store_class().decode(data) for key, data in rows}
    return {key: store_class(key).load() for key in session_keys}


def recheck_viewers(keys) -> dict:
    """Re-check many viewers at once (the hub's keep-alive): ``keys`` are ``(user_id,
    session_key, check_session)``; returns ``{key: Viewer or None}`` as ``recheck_viewer``
    would, in two queries (the users, their sessions) whatever the number of streams."""
    from django.contrib.auth import get_user_model

    keys = list(dict.fromkeys(keys))
    users = get_user_model().objects.filter(
        pk__in={user_id for user_id, _, _ in keys}, is_active=True).in_bulk()
    sessions = _load_sessions({key for _, key, check in keys if check and key})
    result = {}
    for user_id, session_key, check_session in keys:
        user = users.get(user_id)
        if user is None or (check_session and not _session_matches(
                sessions.get(session_key) if session_key else None, user)):
            result[(user_id, session_key, check_session)] = None
        else:
            result[(user_id, session_key, check_session)] = find_viewer(user)
    return result


def session_tag(session_key: str | None) -> str | None:
    # Streams are told which Django session ended by a digest, never the key itself (it is a
    # bearer for the operator's account and the channel layer is not a place for those).
    return hashlib.sha256(session_key.encode()).hexdigest()[:32] if session_key else None


def end_session_streams(user_id, session_key: str | None) -> None:
    """Close the board streams that Django session ``session_key`` of ``user_id`` opened, on
    every process, now (a logout), instead of at their next keep-alive re-check (which stays
    the guarantee: this send is fire and forget). Without a key, every stream of the user
    re-checks itself at once."""
    if user_id is None:
        return
    tag = session_tag(session_key)
    message = ({"type": groups.STOP_MESSAGE_TYPE, "session": tag} if tag
               else {"type": groups.RECHECK_MESSAGE_TYPE})
    publish.send_to_group(groups.viewer_group(user_id), message, context={"user": user_id})
