from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "ingest"

    def ready(self):
        # The MCP read_secret verb reads operator secrets through this hook, so channels_push
        # stays free of imports from ingest (dependencies point ingest -> channels_push).
        from channels_push.mcp import tools as mcp_tools
        from todos import transitions as todo_transitions

        from . import queries
        from .models import OperatorSecret

        mcp_tools.register_secret_reader(queries.read_secret)
        # Operator secrets die with their todo (docs/security.md#stored-secrets): deleted by the
        # very transition that completes or dead-letters it.
        todo_transitions.register_rows_ending_with_todo(OperatorSecret._meta.db_table)
