from django.apps import AppConfig


class ChannelsPushConfig(AppConfig):
    name = "channels_push"

    def ready(self):
        from channels_push.bus import publish
        from channels_push.doorbells import doorbells

        # The bus, below todos and endpoints, calls the doorbell above them only through these
        # registrations, and only after commit (docs/architecture.md#the-layers).
        publish.add_listener(doorbells.ring_ready_todo)
        # A held todo's follow-up or stop request rings its holder.
        publish.add_listener(doorbells.ring_holder_on_change)
        # Presence turned in / paused work resumed (endpoints.transitions): one digest.
        publish.add_endpoint_listener(doorbells.digest_on_endpoint_change)

        # A logout ends the board streams its Django session opened. The signal,
        # not a view: the board's logout, the admin's and OIDC's all end in auth.logout, which
        # sends it. It only sends a message; the streams' keep-alive re-check is the guarantee.
        from django.contrib.auth.signals import user_logged_out

        user_logged_out.connect(_end_board_streams_on_logout,
                                dispatch_uid="switchboard.board_streams.logout")


def _end_board_streams_on_logout(sender, request, user, **kwargs):
    from .board import rights

    session = getattr(request, "session", None)
    rights.end_session_streams(getattr(user, "pk", None),
                               getattr(session, "session_key", None))
