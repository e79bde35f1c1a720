"""A real OTLP/HTTP trace receiver for tests (docs/operating.md#traces): an http.server on a
free port of 127.0.0.1 that takes ``POST /v1/traces`` as the OTLP specification describes it
(``Content-Type: application/x-protobuf``, an ``ExportTraceServiceRequest``, optionally
gzip-encoded), decodes it with opentelemetry-proto, and answers an
``ExportTraceServiceResponse``. Anything else is a problem the test fails on.

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 3)

Each span is a ``Span`` with hex ids, its attributes as a plain dict and the resource's
attributes of the process that exported it.
"""

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.processes import DEADLINE_SECONDS, poll


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict
    links: list  # (trace_id, span_id) pairs
    resource: dict = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in any_value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: _value(item.value) for item in any_value.kvlist_value.values}
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode_spans(body: bytes) -> list[Span]:
    """The spans of one ExportTraceServiceRequest (raises DecodeError on anything else)."""
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(Span(
                    name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                    attributes=_attributes(span.attributes),
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    resource=resource, start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano))
    return spans


class OtlpReceiver:
    def __init__(self):
        self.spans: list[Span] = []
        self.problems: list[str] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                problem = receiver._take(self.path, self.headers, body)
                if problem:
                    self.send_response(400)
                    self.end_headers()
                    return
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take(self, path: str, headers, body: bytes) -> str:
        problem = ""
        if path != "/v1/traces":
            problem = f"POST to {path}, not /v1/traces"
        elif headers.get("Content-Type") != "application/x-protobuf":
            problem = f"Content-Type {headers.get('Content-Type')!r}"
        else:
            try:
                if headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode_spans(body)
            except Exception as error:  # noqa: BLE001 - any undecodable body is the problem
                problem = f"undecodable ExportTraceServiceRequest: {error!r}"
        with self._lock:
            self.requests += 1
            if problem:
                self.problems.append(problem)
            else:
                self.spans.extend(spans)
        return problem

    def start(self) -> "OtlpReceiver":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate, deadline_seconds: float = DEADLINE_SECONDS) -> list[Span]:
        """The spans once ``predicate(spans)`` holds (polled with a deadline); the test fails
        naming what arrived when it does not."""
        if not poll(lambda: predicate(self.snapshot()), deadline_seconds=deadline_seconds):
            arrived = [(span.name, span.resource.get("switchboard.process"))
                       for span in self.snapshot()]
            raise AssertionError(f"spans not as expected within {deadline_seconds} s: {arrived}")
        return self.snapshot()
