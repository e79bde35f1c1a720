"""What every stand-in of a source's API shares (ingest/tests/github_standin.py,
gitlab_standin.py, gitea_standin.py, slack_standin.py, linear_standin.py): a threaded HTTP server on a loopback
port, each request kept in ``seen``, each broken rule of the source's published description in
``problems``, and faults to answer with (the source down, a rate limit). A stand-in says which
operation of its description a request is, what it breaks of it and what the source would
answer; ``route`` does the rest the same way for every source."""

import importlib
import itertools
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest


def import_pinned(package: str, *modules: str) -> list:
    """``modules`` of the pinned ``package`` (requirements.txt) a stand-in reads its source's
    description from. Skips when it is not installed, except under CI, which must check
    requests against the description and fails instead."""
    try:
        return [importlib.import_module(module) for module in modules]
    except ImportError:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must install {package} (requirements.txt)") from None
        pytest.skip(f"{package} is not installed, so the source's published description cannot "
                    "be read: pip install -r requirements.txt")


def template_pattern(template: str) -> re.Pattern:
    """A path template of a description (``/repos/{owner}/{repo}``) as a pattern: each
    ``{param}`` is one segment, captured by its name."""
    parts = []
    for segment in template.strip("/").split("/"):
        name = re.fullmatch(r"\{(\w+)\}", segment)
        parts.append(f"(?P<{name.group(1)}>[^/]+)" if name else re.escape(segment))
    return re.compile("^/" + "/".join(parts) + "$")


@dataclass
class Seen:
    method: str
    path: str
    operation: str
    headers: dict
    body: object
    status: int = 0
    query: dict = field(default_factory=dict)
    answer: object = None  # the JSON answered


@dataclass
class Fault:
    """Answer ``status`` (with ``headers``) to the next ``times`` requests, or to every one
    while ``times`` is None (the source is down)."""

    status: int
    headers: dict = field(default_factory=dict)
    times: int | None = 1
    message: str = "Service Unavailable"
    code: str = ""  # an error code the source's answer names (Linear's RATELIMITED)


class StandIn:
    """A source's API on a loopback port, under ``prefix`` (``/api/v4``, ``/api/v1``, or a GitHub
    Enterprise Server's ``/api/v3``)."""

    def __init__(self, *, prefix: str = ""):
        self.prefix = prefix
        self.seen: list[Seen] = []
        self.problems: list[str] = []
        self.faults: list[Fault] = []
        # operation id -> (reached, release): its next request is carried out, then its answer
        # waits until ``release`` is set (a worker can be killed while the source has acted).
        self.holds: dict = {}
        self._ids = itertools.count(1001)
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"standin": self})
        self.server = _QuietServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{self.prefix}"

    def load(self) -> None:
        self.operations()  # the description, read before the first request

    def start(self):
        self.load()
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def fail(self, status: int, *, headers=None, times: int | None = 1,
             message: str = "Service Unavailable", code: str = "") -> None:
        with self._lock:
            self.faults.append(Fault(status, dict(headers or {}), times, message, code))

    def recover(self) -> None:
        with self._lock:
            self.faults.clear()

    def hold_answer(self, operation_id: str) -> tuple[threading.Event, threading.Event]:
        """Carry out the next ``operation_id`` request, then hold its answer: returns
        ``(reached, release)``; ``reached`` is set once the request was carried out, and the
        answer goes when ``release`` is set (or after a minute)."""
        events = (threading.Event(), threading.Event())
        with self._lock:
            self.holds[operation_id] = events
        return events

    def requests_to(self, operation_id: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.operation == operation_id]

    def take_fault(self) -> Fault | None:
        with self._lock:
            if not self.faults:
                return None
            fault = self.faults[0]
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self.faults.pop(0)
            return fault

    def fault_answer(self, fault: Fault) -> tuple[int, object, dict]:
        """How the source words a fault's answer (GitHub and Gitea: ``{"message": …}``)."""
        return fault.status, {"message": fault.message}, fault.headers

    # What a subclass says: the description's name (for problems), its operations (each with
    # ``id``, ``method`` and a path ``pattern``), what a request breaks of one, and the answer.
    description = "the description"

    def operations(self) -> list:
        raise NotImplementedError

    def find_operation(self, method: str, api_path: str):
        """``(operation, path values)`` of the description that takes ``method api_path``, or
        None. The first of ``operations`` whose pattern matches."""
        return next(((op, found.groupdict()) for op in self.operations() if op.method == method
                     for found in [op.pattern.match(api_path)] if found), None)

    def read_body(self, seen: Seen, raw: bytes) -> tuple[int, object] | None:
        """``raw`` into ``seen.body`` as the source reads a body (JSON here), or the answer to a
        body it cannot read."""
        try:
            seen.body = json.loads(raw) if raw else None
        except ValueError:
            self.problems.append(f"{seen.method} {seen.path}: body is not JSON")
            return 400, {"message": "Problems parsing JSON"}
        return None

    def unknown_answer(self) -> tuple[int, object]:
        """How the source answers a request no operation takes."""
        return 404, {"message": "Not Found"}

    def invalid_answer(self, problems: list[str]) -> tuple[int, object]:
        """How the source answers a request that breaks its operation's rules."""
        return 422, {"message": "Validation Failed", "errors": problems}

    def request_problems(self, operation, values: dict, seen: Seen) -> list[str]:
        raise NotImplementedError

    def answer(self, operation, values: dict, seen: Seen) -> tuple[int, object]:
        raise NotImplementedError

    def route(self, method: str, api_path: str, seen: Seen) -> tuple[int, object, dict]:
        """The answer to one request under the prefix: ``(status, JSON, headers)``. Names its
        operation in ``seen.operation``; a request no operation takes, or one that breaks the
        operation's rules, is refused (404, 422) and kept in ``problems``; else the next
        fault, if any; else ``answer`` under the lock."""
        match = self.find_operation(method, api_path)
        if match is None:
            self.problems.append(f"{method} {api_path}: no such operation in {self.description}")
            return (*self.unknown_answer(), {})
        operation, values = match
        seen.operation = operation.id
        problems = self.request_problems(operation, values, seen)
        if problems:
            self.problems.extend(problems)
            return (*self.invalid_answer(problems), {})
        fault = self.take_fault()
        if fault is not None:
            return self.fault_answer(fault)
        with self._lock:
            return (*self.answer(operation, values, seen), {})

    def next_id(self) -> int:
        return next(self._ids)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that went away mid-request (a worker killed on purpose) is not a failure of
        # the stand-in; anything else is printed as usual.
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    standin: StandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet: the test reads ``seen``
        pass

    def _serve(self):
        standin = self.standin
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {name.lower(): value for name, value in self.headers.items()}
        path, _, query = self.path.partition("?")
        seen = Seen(self.command, path, "", headers, None,
                    query={name: values[-1] for name, values in parse_qs(query).items()})
        standin.seen.append(seen)
        unreadable = standin.read_body(seen, raw)
        if unreadable is not None:
            return self._reply(*unreadable, seen)
        if not path.startswith(standin.prefix + "/"):
            standin.problems.append(f"{self.command} {path}: outside the API prefix")
            return self._reply(*standin.unknown_answer(), seen)
        status, answer, extra = standin.route(self.command, path[len(standin.prefix):], seen)
        with standin._lock:
            hold = standin.holds.pop(seen.operation, None)
        if hold is not None:
            reached, release = hold
            reached.set()
            release.wait(60)
        return self._reply(status, answer, seen, extra)

    def _reply(self, status, answer, seen, headers=None):
        seen.status, seen.answer = status, answer
        data = b"" if status == 204 else json.dumps(answer, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve


def wait_for(condition, *, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``condition`` until it returns something true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
