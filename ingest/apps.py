from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "ingest"

    def ready(self):
        # The MCP read_secret verb reads operator secrets through this hook, so channels_push
        # stays free of imports from ingest (dependencies point ingest -> channels_push).
        from channels_push.mcp import tools as mcp_tools

        from . import queries

        mcp_tools.register_secret_reader(queries.read_secret)
