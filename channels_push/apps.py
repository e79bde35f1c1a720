from django.apps import AppConfig


class ChannelsPushConfig(AppConfig):
    name = "channels_push"

    def ready(self):
        from . import doorbells, publish

        # The doorbell rides the one after-commit publish path (STYLE: side effects only after
        # commit): a ready todo rings once its transaction has committed, never before.
        publish.add_listener(doorbells.ring_ready_todo)
        # Presence turned in / paused work resumed (endpoints.transitions): one digest.
        publish.add_endpoint_listener(doorbells.digest_on_endpoint_change)
