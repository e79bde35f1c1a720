"""OpenTelemetry traces, configured by the standard variables only (docs/operating.md#traces).

One trace per piece of work: the delivery (or the hand-over) starts it, or continues the W3C
``traceparent`` its request carried; the todo stores the delivery's ``traceparent``
(``work_traceparent`` while the delivery runs), and every later span about the todo (a tool
call, a doorbell, a write-back) names that as its parent, in whichever process it runs.

The OpenTelemetry API is installed whatever we choose: the mcp SDK imports it itself (its
client and server spans). So only the SDK and the OTLP/HTTP exporter are our dependencies, and
they are imported only when an endpoint is configured. Unset (no ``OTEL_EXPORTER_OTLP_ENDPOINT``),
every call here is a check of one module variable: ``span`` hands back one shared no-op. Only
ids, names, states, sizes and codes go into attributes, never a bearer, secret, payload, title
or result text (a test walks every exported attribute).
"""

import contextvars
import logging
import os
import re
import time
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger("switchboard.tracing")

# version-traceid-parentid-flags, lower-case hex (W3C Trace Context, level 1). Version ff is
# invalid; an all-zero trace or parent id is invalid.
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
DEFAULT_SERVICE_NAME = "switchboard"
# The only protocol the exporter shipped speaks (opentelemetry-exporter-otlp-proto-http).
SUPPORTED_PROTOCOL = "http/protobuf"
# OTLP path of the trace signal under OTEL_EXPORTER_OTLP_ENDPOINT, as the exporter appends it.
TRACES_PATH = "/v1/traces"

_tracer = None
_provider = None
# The OpenTelemetry API's modules and span kinds, bound by ``configure`` (never imported when
# traces are off).
_api = _context_api = None
_KINDS = {}
# The traceparent of the delivery being turned into todos on this thread (``delivery``):
# what ``todos.transitions.create_todo_params`` stores on each todo it makes.
_work = contextvars.ContextVar("switchboard_work_traceparent", default=None)


def valid_traceparent(value) -> str | None:
    """``value`` when it is a W3C traceparent this process may continue, else None."""
    if not isinstance(value, str) or len(value) != 55:
        return None
    match = _TRACEPARENT_RE.match(value)
    if (match is None or match[1] == "ff" or match[2] == "0" * 32 or match[3] == "0" * 16):
        return None
    return value


def enabled() -> bool:
    return _tracer is not None


def _environment_variable(*names: str) -> tuple[str, str]:
    """The first of ``names`` set to a non-blank value, and that value; ("", "") if none is."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return "", ""


def exporter_endpoint() -> tuple[str | None, str]:
    """``(the URL spans are sent to, "")`` when the environment turns traces on, else ``(None,
    why they are off)``. Raises ImproperlyConfigured, naming the variable and what it may be,
    for a value the shipped exporter cannot honour."""
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
        raise ImproperlyConfigured(
            f"OTEL_TRACES_EXPORTER={exporters!r} is not supported: switchboard exports traces "
            "with 'otlp' only (or 'none': no traces)")
    protocol_name, protocol = _environment_variable("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                                    "OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != SUPPORTED_PROTOCOL:
        raise ImproperlyConfigured(
            f"{protocol_name}={protocol!r} is not supported: switchboard exports traces over "
            f"{SUPPORTED_PROTOCOL!r} only (set {protocol_name}={SUPPORTED_PROTOCOL} or unset it)")
    if name == "OTEL_EXPORTER_OTLP_ENDPOINT":
        endpoint = endpoint.removesuffix("/") + TRACES_PATH
    return endpoint, ""


def shown_endpoint(url: str) -> str:
    """``url`` fit for a log line: scheme, host, port and path, no user:password or query."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


# The loggers the exporter's failures reach: the exporter and its HTTP client (retries and
# errors quote the URL, or the connection error that does), the batch processor, urllib3's pool.
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.common.http",
                    "opentelemetry.exporter.otlp.proto.http._common",
                    "opentelemetry.sdk._shared_internal", "urllib3.connectionpool")
# A URL's user:password@, and any query (an ingest key: ``?api_key=…``), where a URL or a
# path appears in a log line.
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@'\"]*@")
_QUERY_RE = re.compile(r"\?[^\s'\"<>()]*=[^\s'\"<>()]*")


def redact_urls(text: str) -> str:
    return _QUERY_RE.sub("", _USERINFO_RE.sub(r"\1", text))


class RedactUrls(logging.Filter):
    """Rewrites a record's message (and its traceback) without URL userinfo or queries."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_urls(record.getMessage()), ()
        if record.exc_info:
            record.exc_text = redact_urls(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


_REDACT_URLS = RedactUrls()


def redact_exporter_logs() -> None:
    for name in EXPORTER_LOGGERS:
        if _REDACT_URLS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_REDACT_URLS)


def configure(process: str) -> bool:
    """Start exporting when the environment names an OTLP endpoint (``process``: web, worker
    or beat, the resource attribute "switchboard.process" of every span it exports), and log
    one line saying whether traces are on (and where they go) or off (and why).
    Returns whether traces are on. Raises ImproperlyConfigured (``exporter_endpoint``).
    Idempotent: a second call keeps the first provider."""
    global _tracer, _provider, _api, _context_api, _KINDS
    if _tracer is not None:
        return True
    endpoint, why_off = exporter_endpoint()
    if endpoint is None:
        log.info("traces off", extra={"role": process, "reason": why_off})
        return False
    from opentelemetry import context, trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; the SDK's own
    # fallback name (unknown_service) gives way to ours. The sampler is the SDK's reading of
    # OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG.
    resource = Resource.create({"switchboard.process": process})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    redact_exporter_logs()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _api, _context_api = trace, context
    _KINDS = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT,
              "internal": trace.SpanKind.INTERNAL}
    _provider = provider
    _tracer = provider.get_tracer("switchboard")
    log.info("traces on", extra={"role": process, "endpoint": shown_endpoint(endpoint),
                                 "service": resource.attributes.get(SERVICE_NAME)})
    return True


def start(process: str) -> bool:
    """``configure`` at a process's start: a configuration it refuses ends the process with
    that one-line message (exit status 1), not a traceback."""
    try:
        return configure(process)
    except ImproperlyConfigured as error:
        raise SystemExit(f"switchboard: {error}") from None


def shutdown() -> None:
    """Flush what is buffered and stop exporting (process exit, tests)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def force_flush() -> None:
    if _provider is not None:
        _provider.force_flush()


class _NoSpan:
    """What ``span`` yields when traces are off: every call does nothing."""

    traceparent = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set(self, **attributes) -> None:
        pass

    def link(self, *traceparents) -> None:
        pass


NO_SPAN = _NoSpan()


def _span_context(traceparent: str | None):
    """The SpanContext a valid W3C ``traceparent`` names, else None."""
    if valid_traceparent(traceparent) is None:
        return None
    return _api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16),
                            is_remote=True, trace_flags=_api.TraceFlags(int(traceparent[53:], 16)))


def _context_of(traceparent: str | None):
    found = _span_context(traceparent)
    return None if found is None else _api.set_span_in_context(_api.NonRecordingSpan(found))


def _links_of(traceparents):
    # An unsampled one names a span nobody recorded (a runner's dropped "MCP send" span).
    found = (_span_context(value) for value in dict.fromkeys(traceparents))
    return [_api.Link(context) for context in found
            if context is not None and context.trace_flags.sampled]


def _start(name, parent, links, kind, attributes, start_ns):
    # With no parent of its own a span starts a trace (or continues the ambient one of the
    # delivery it runs inside).
    return _tracer.start_span(
        name, context=_context_of(parent), kind=_KINDS[kind], links=_links_of(links),
        attributes={key: value for key, value in attributes.items() if value is not None},
        start_time=start_ns)


class _Span:
    def __init__(self, name, *, parent, links, kind, attributes, start_ns):
        self._span = _start(name, parent, links, kind, attributes, start_ns)
        self._token = None

    @property
    def traceparent(self) -> str:
        found = self._span.get_span_context()
        return f"00-{found.trace_id:032x}-{found.span_id:016x}-{int(found.trace_flags):02x}"

    def set(self, **attributes) -> None:
        self._span.set_attributes(
            {key: value for key, value in attributes.items() if value is not None})

    def link(self, *traceparents) -> None:
        """Link to each valid traceparent, learnt after the span began (a repeat's todo)."""
        for found in _links_of(traceparents):
            self._span.add_link(found.context)

    def __enter__(self):
        self._token = _context_api.attach(_api.set_span_in_context(self._span))
        return self

    def __exit__(self, kind, error, _traceback):
        if error is not None:
            # The exception's type only: its message may quote what a span must not carry.
            self._span.set_attribute("error.type", kind.__qualname__)
            self._span.set_status(_api.StatusCode.ERROR)
        _context_api.detach(self._token)
        self._span.end()
        return False


def record(name: str, *, start_ns: int | None, parent: str | None = None, links=(),
           kind: str = "internal", **attributes) -> None:
    """A span that has already happened (from ``start_ns``, a ``now_ns()``, to now), recorded
    once its parent is known: a claim_next learns its todo at the end. Nothing when off."""
    if _tracer is not None:
        _start(name, parent, links, kind, attributes, start_ns).end()


def span(name: str, *, parent: str | None = None, links=(), kind: str = "internal",
         start_ns: int | None = None, **attributes):
    """A span named ``name`` (a context manager yielding an object with ``set(**attributes)``
    and ``traceparent``), child of the W3C ``parent`` when it is valid, else of the span
    current on this thread (a new trace when there is none), linked to each valid traceparent
    of ``links``. ``start_ns``: when it began, if before now. Attributes whose value is None
    are left out."""
    if _tracer is None:
        return NO_SPAN
    return _Span(name, parent=parent, links=links, kind=kind, attributes=attributes,
                 start_ns=start_ns)


def now_ns() -> int | None:
    """The start of a span recorded later (``record``); None when traces are off."""
    return None if _tracer is None else time.time_ns()


class _Delivery:
    """``delivery``'s context manager: while it runs, ``work_traceparent`` is the trace the
    todos it makes belong to."""

    def __init__(self, span_, traceparent):
        self.span = span_
        self._traceparent = traceparent
        self._token = None

    def __enter__(self):
        self.span.__enter__()
        self._token = _work.set(self.span.traceparent or self._traceparent)
        return self.span

    def __exit__(self, *exc):
        _work.reset(self._token)
        return self.span.__exit__(*exc)


class _Kept:
    """``delivery`` with traces off: only the header's traceparent, kept for the todos."""

    __slots__ = ("_traceparent", "_token")

    def __init__(self, traceparent):
        self._traceparent = traceparent

    def __enter__(self):
        self._token = _work.set(self._traceparent)
        return NO_SPAN

    def __exit__(self, *exc):
        _work.reset(self._token)
        return False


def delivery(name: str, header: str | None, *, links=(), **attributes):
    """The span of one piece of work's arrival (a webhook delivery, a hand-over, a
    redelivery), continuing the request's ``traceparent`` header when it is valid, linked to
    each of ``links``. Traces off, the header (when valid) is still what the todos store, so an
    agent's own exporter can join its sender's trace."""
    traceparent = valid_traceparent(header) if header else None
    if _tracer is None:
        return _Kept(traceparent)
    return _Delivery(span(name, parent=traceparent, links=links, kind="server", **attributes),
                     traceparent)


def work_traceparent() -> str | None:
    """The traceparent of the delivery running on this thread (``delivery``), or None."""
    return _work.get()
