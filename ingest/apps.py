from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "ingest"

    def ready(self):
        from channels_push.bus import publish

        from . import write_back

        # A committed transition of a todo whose source hears of it wakes the write-back
        # sender (docs/write-back.md#the-outbox); the bus calls up only through this.
        publish.add_listener(write_back.on_todo_change)
