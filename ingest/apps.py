from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "ingest"

    def ready(self):
        from todos import transitions as todo_transitions

        from .models import OperatorSecret

        # Operator secrets die with their todo (docs/security.md#stored-secrets): deleted by the
        # very transition that completes or dead-letters it.
        todo_transitions.register_rows_ending_with_todo(OperatorSecret._meta.db_table)
