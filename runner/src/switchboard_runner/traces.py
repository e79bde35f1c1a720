"""The runner's own spans — claim, run, settle — in each todo's trace (docs/runner.md#traces).

They are exported only when the runner's environment names an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT``, the standard variables read as the server reads them:
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn them off, and a protocol or
exporter other than OTLP over http/protobuf is refused at start) and the optional ``traces``
extra (the OpenTelemetry SDK and its OTLP/HTTP exporter) is installed. Otherwise nothing is
imported and every span is a no-op; the agent still gets the todo's ``TRACEPARENT``, so a CLI
that exports joins the trace on its own. The start says which, in one line.

With the exporter on, the SDK's provider is made the global one, so the mcp SDK's own client
spans nest under these and its requests carry their ``traceparent`` in ``_meta``.
"""

import logging
import os
import re
import time
from urllib.parse import urlsplit

from .session import log_event

# version-traceid-parentid-flags (W3C Trace Context), as the server sends it.
_TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
DEFAULT_SERVICE_NAME = "switchboard-runner"
# What the exporter of the ``traces`` extra (opentelemetry-exporter-otlp-proto-http) speaks.
SUPPORTED_PROTOCOL = "http/protobuf"
TRACES_PATH = "/v1/traces"

_tracer = None


class Unsupported(ValueError):
    """An OpenTelemetry variable set to what the runner cannot honour (the message names it)."""


def valid_traceparent(value) -> str | None:
    match = _TRACEPARENT_RE.match(value) if isinstance(value, str) else None
    if match is None or int(match[1], 16) == 0 or int(match[2], 16) == 0:
        return None
    return value


def _environment_variable(*names: str) -> tuple[str, str]:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return "", ""


def exporter_endpoint() -> tuple[str | None, str]:
    """``(the URL spans are sent to, "")`` when the environment turns spans on, else ``(None,
    why they are off)``. Raises Unsupported for a protocol or exporter it cannot use."""
    if _environment_variable("OTEL_SDK_DISABLED")[1].lower() == "true":
        return None, "OTEL_SDK_DISABLED=true"
    exporters = _environment_variable("OTEL_TRACES_EXPORTER")[1].lower()
    if exporters == "none":
        return None, "OTEL_TRACES_EXPORTER=none"
    name, endpoint = _environment_variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                           "OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None, "OTEL_EXPORTER_OTLP_ENDPOINT is not set"
    if {item.strip() for item in exporters.split(",")} - {"", "otlp"}:
        raise Unsupported(f"OTEL_TRACES_EXPORTER={exporters!r} is not supported: the runner "
                          "exports traces with 'otlp' only (or 'none': no traces)")
    protocol_name, protocol = _environment_variable("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                                    "OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != SUPPORTED_PROTOCOL:
        raise Unsupported(
            f"{protocol_name}={protocol!r} is not supported: the runner exports traces over "
            f"{SUPPORTED_PROTOCOL!r} only (set {protocol_name}={SUPPORTED_PROTOCOL} or unset it)")
    if name == "OTEL_EXPORTER_OTLP_ENDPOINT":
        endpoint = endpoint.removesuffix("/") + TRACES_PATH
    return endpoint, ""


# Where the exporter's failures are logged (the exporter, its HTTP client, the batch
# processor, urllib3's pool): their text may quote the export URL.
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.common.http",
                    "opentelemetry.exporter.otlp.proto.http._common",
                    "opentelemetry.sdk._shared_internal", "urllib3.connectionpool")
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@'\"]*@")
_QUERY_RE = re.compile(r"\?[^\s'\"<>()]*=[^\s'\"<>()]*")


def redact_urls(text: str) -> str:
    """``text`` without any URL's user:password@ or query (an ingest key: ``?api_key=…``)."""
    return _QUERY_RE.sub("", _USERINFO_RE.sub(r"\1", text))


class RedactUrls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_urls(record.getMessage()), ()
        if record.exc_info:
            record.exc_text = redact_urls(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


_REDACT_URLS = RedactUrls()


def _shown(url: str) -> str:
    # No user:password or query (an API key) in a log line.
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def configure() -> bool:
    """Export when the environment names an OTLP endpoint and the SDK is installed; returns
    whether spans are on, having logged one line that says so (``traces_on endpoint=…``) or
    why not (``traces_off reason=…``). Raises Unsupported (``exporter_endpoint``)."""
    global _tracer
    if _tracer is not None:
        return True
    endpoint, why_off = exporter_endpoint()
    if endpoint is None:
        log_event("traces_off", reason=why_off)
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log_event("traces_off", reason="OTEL_EXPORTER_OTLP_ENDPOINT is set but the traces extra "
                  "is not installed (pip install 'switchboard-runner[traces]')")
        return False
    for name in EXPORTER_LOGGERS:
        if _REDACT_URLS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_REDACT_URLS)
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # The SDK's sampler as OTEL_TRACES_SAMPLER names it, minus the mcp SDK's parentless roots.
    provider = TracerProvider(resource=resource, sampler=_without_mcp_roots(
        TracerProvider(shutdown_on_exit=False).sampler))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("switchboard-runner")
    log_event("traces_on", endpoint=_shown(endpoint), service=resource.attributes[SERVICE_NAME])
    return True


# The name of every span the mcp SDK makes for a request it sends.
MCP_CLIENT_SPAN_PREFIX = "MCP send "


def _without_mcp_roots(sampler):
    """``sampler``, except that an mcp SDK client span with no parent is dropped: a call the
    runner makes outside any span of its own (initialize, tools/list, each idle claim_next
    poll) would otherwise start a one-span trace. Dropped, its ``_meta`` traceparent says
    "not sampled", and the server links to no such span."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class WithoutMcpRoots(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                          links=None, trace_state=None):
            parent = trace.get_current_span(parent_context).get_span_context()
            if name.startswith(MCP_CLIENT_SPAN_PREFIX) and not parent.is_valid:
                return SamplingResult(Decision.DROP)
            return sampler.should_sample(parent_context, trace_id, name, kind, attributes,
                                         links, trace_state)

        def get_description(self):
            return f"WithoutMcpRoots{{{sampler.get_description()}}}"

    return WithoutMcpRoots()


def shutdown() -> None:
    """Flush what is buffered (the runner's exit)."""
    global _tracer
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()
    _tracer = None


class _NoSpan:
    def __init__(self, traceparent):
        self.traceparent = traceparent

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Span:
    def __init__(self, name, parent, start_ns, attributes):
        from opentelemetry import context, trace

        self._context, self._trace = context, trace
        parent_context = None
        if valid_traceparent(parent):
            _, trace_id, span_id, flags = parent.split("-")
            parent_context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
                int(trace_id, 16), int(span_id, 16), is_remote=True,
                trace_flags=trace.TraceFlags(int(flags, 16)))))
        self._span = _tracer.start_span(
            name, context=parent_context, start_time=start_ns,
            attributes={k: v for k, v in attributes.items() if v is not None})
        found = self._span.get_span_context()
        self.traceparent = (f"00-{found.trace_id:032x}-{found.span_id:016x}"
                            f"-{int(found.trace_flags):02x}")
        self._token = None

    def __enter__(self):
        self._token = self._context.attach(self._trace.set_span_in_context(self._span))
        return self

    def __exit__(self, kind, error, _traceback):
        if error is not None:
            self._span.set_attribute("error.type", kind.__qualname__)
            self._span.set_status(self._trace.StatusCode.ERROR)
        self._context.detach(self._token)
        self._span.end()
        return False


def span(name: str, todo: dict, *, start_ns: int | None = None, **attributes):
    """A span about ``todo``, child of its ``traceparent`` (the delivery's span), carrying its
    id and queue (ids and names only: never its title, payload or an agent's output).
    ``.traceparent`` is this span's own when spans are on, else the todo's."""
    if _tracer is None:
        return _NoSpan(valid_traceparent(todo.get("traceparent")))
    return _Span(name, todo.get("traceparent"), start_ns,
                 {"switchboard.todo_id": str(todo.get("id")),
                  "switchboard.queue": todo.get("queue"), **attributes})


def now_ns() -> int | None:
    return None if _tracer is None else time.time_ns()
