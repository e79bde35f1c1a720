"""The runner (``runner/``, the ``switchboard_runner`` package and its checkout script
``runner/switchboard_runner.py``) against a real daphne on PostgreSQL + Redis: the runner is
started as its own process, outside the repository's import path, and the agent commands are
small Python and sh scripts that record what they saw."""

import ast
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory
from tests.processes import DEADLINE_SECONDS, poll
from todos import sweeps
from todos import queries, transitions
from todos.models import Todo, TodoEvent

pytestmark = pytest.mark.django_db(transaction=True)

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "runner" / "switchboard_runner.py"
RUNNER_PACKAGE = REPO_ROOT / "runner" / "src" / "switchboard_runner"
TOKEN_ENV = "SB_TEST_RUNNER_TOKEN"
ENDPOINT_NUMBERS = itertools.count(1)


def load_runner_module(name="agent"):
    """One module of the runner package, imported from the checkout (not installed here)."""
    if str(RUNNER_PACKAGE.parent) not in sys.path:
        sys.path.insert(0, str(RUNNER_PACKAGE.parent))
    return importlib.import_module(f"switchboard_runner.{name}")


class RunnerProcess:
    """``switchboard_runner.py`` as an agent machine runs it: its own process, cwd outside the
    repository and no PYTHONPATH, so an import of server code would fail."""

    def __init__(self, url, credential, *flags, command, program=(sys.executable, str(RUNNER)),
                 env=None):
        """``program``: how the runner is started (default the checkout script; an installed
        ``switchboard-runner`` for the package); ``env``: more variables for the runner."""
        runner_env = {key: value for key, value in os.environ.items()
                      if key not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "DATABASE_URL")}
        runner_env.update(env or {})
        if credential is not None:  # None: the flags say where it is (--token-file)
            runner_env[TOKEN_ENV] = credential
        self._log = tempfile.NamedTemporaryFile(prefix="runner-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [*program, "--url", url, "--token-env", TOKEN_ENV, *flags, "--", *command],
            cwd=tempfile.gettempdir(), env=runner_env, stdout=subprocess.PIPE,
            stderr=self._log, text=True)

    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_log(self, text, deadline_seconds=DEADLINE_SECONDS):
        assert poll(lambda: text in self.log_text(), deadline_seconds), self.log_text()

    def wait(self, timeout=DEADLINE_SECONDS) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"runner did not exit:\n{self.log_text()}") from None

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def runners():
    started = []

    def start(*args, **kwargs):
        runner = RunnerProcess(*args, **kwargs)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop()


@pytest.fixture
def setup(daphne_server):
    """A fresh endpoint (scope '*') on the live server: ``(endpoint, credential, mcp_url)``."""
    counter = next(ENDPOINT_NUMBERS)
    owner = UserFactory(username=f"runner-owner-{counter}")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=f"runner-{counter}", owner=owner)
    return endpoint, credential, f"{daphne_server.url}/mcp/{endpoint.slug}"


def make_todos(endpoint, count, queue="inbox", trust="signed", payload=None):
    """Signed todos (what the runner takes by default), unless ``trust`` says otherwise."""
    return [transitions.create_todo(endpoint=endpoint, queue=queue, title=f"job {n} of {count}",
                                    actor="test", payload={"n": n} if payload is None else payload,
                                    trust=trust)[0]
            for n in range(count)]


def agent(tmp_path, name, body) -> list[str]:
    """A Python agent script; the command that runs it."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


class StartStamp:
    """An agent command that writes the wall-clock time it started: ``seconds_after(t)`` is
    how long after ``t`` (a ``time.time()``) the runner got it going."""

    def __init__(self, tmp_path):
        self.path = tmp_path / "started"
        self.command = ["sh", "-c", f"date +%s.%N > {self.path}"]

    def seconds_after(self, at: float, runner) -> float:
        assert poll(lambda: self.path.exists() and self.path.read_text().strip()), \
            runner.log_text()
        return float(self.path.read_text()) - at


# How long a runner's fallback would take to find a todo in the wake-up tests below (their
# --poll-seconds): a wake-up well inside half of it came by the path under test (doorbell, digest,
# long poll), however loaded the machine. How fast that path is, is bench/'s business.
FALLBACK_POLL_SECONDS = 60


def start_idle_runner(runners, url, credential, tmp_path, *flags):
    """A runner whose agent stamps its start time, once it is idle with its stream open:
    ``(runner, stamp)``."""
    stamp = StartStamp(tmp_path)
    runner = runners(url, credential, *flags, command=stamp.command)
    runner.wait_log("idle")
    slug = url.rsplit("/", 1)[1]
    assert poll(lambda: McpSession.objects.filter(endpoint__slug=slug, open_streams__gt=0)
                .exists())
    return runner, stamp


def completions(todo):
    return TodoEvent.objects.filter(todo=todo, action="complete").count()


# -- exit 0 / non-zero / hang / the agent settles it itself ---------------------------------------


def test_exit_zero_completes_with_the_stdout_tail_and_the_agent_sees_its_todo(setup, runners,
                                                                             tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    seen = tmp_path / "seen.json"
    command = agent(tmp_path, "ok", f"""
        import json, os, sys
        todo = json.load(sys.stdin)
        json.dump({{"stdin": todo, "argv": sys.argv[1:],
                   "env": {{k: os.environ.get(k) for k in ("SWITCHBOARD_TODO_ID",
                           "SWITCHBOARD_LEASE_ID", "SWITCHBOARD_URL", "TRACEPARENT")}},
                   "pgid": os.getpgid(0), "pid": os.getpid()}}, open({str(seen)!r}, "w"))
        print("noise " * 2000)
        print("the-last-words")
    """) + ["id={todo_id}", "title={title}", "{todo_json}", "{other} braces stay"]

    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()

    todo.refresh_from_db()
    assert todo.state == "done"
    assert todo.result["exit_code"] == 0
    assert todo.result["stdout_tail"].endswith("the-last-words\n")
    assert len(todo.result["stdout_tail"]) <= 4000  # a tail, not the whole output
    got = json.loads(seen.read_text())
    assert got["stdin"]["id"] == str(todo.pk) and got["stdin"]["payload"] == {"n": 0}
    assert got["env"] == {"SWITCHBOARD_TODO_ID": str(todo.pk),
                          "SWITCHBOARD_LEASE_ID": got["stdin"]["lease_id"],
                          "SWITCHBOARD_URL": url,
                          "TRACEPARENT": None}  # its todo has no trace
    assert got["argv"][:2] == [f"id={todo.pk}", "title=job 0 of 1"]
    assert json.loads(got["argv"][2])["id"] == str(todo.pk)
    assert got["argv"][3] == "{other} braces stay"
    assert got["pgid"] == got["pid"]  # its own process group
    log = runner.log_text()
    for event in ("claim todo_id", "start todo_id", "exit todo_id", "completed todo_id"):
        assert event in log
    assert credential not in log


def test_the_agent_sees_traceparent_in_its_todos_trace_and_the_runner_exports_its_spans(
        setup, runners, tmp_path):
    from switchboard import tracing
    from tests.otlp_receiver import OtlpReceiver

    endpoint, credential, url = setup
    delivery = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with tracing.delivery("test arrival", delivery):  # traces off here: the header is kept
        [todo] = make_todos(endpoint, 1)
    assert todo.traceparent == delivery
    seen = tmp_path / "seen.json"
    command = agent(tmp_path, "env", f"""
        import json, os
        json.dump({{k: os.environ.get(k) for k in ("TRACEPARENT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "OTEL_SERVICE_NAME")}}, open({str(seen)!r}, "w"))
    """)
    with OtlpReceiver() as receiver:
        runner = runners(url, credential, "--once", "--pass-env", "OTEL_EXPORTER_OTLP_ENDPOINT",
                         command=command, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                                               "OTEL_SERVICE_NAME": "runner-under-test"})
        assert runner.wait() == 0, runner.log_text()
        spans = receiver.wait_for(lambda got: {"claim", "run", "settle"} <= {s.name for s in got})
        assert receiver.problems == []
    assert (f"traces_on endpoint={receiver.url}/v1/traces service=runner-under-test"
            in runner.log_text())
    got = json.loads(seen.read_text())
    # Given with --pass-env; OTEL_SERVICE_NAME was not, so the agent does not get it.
    assert got["OTEL_EXPORTER_OTLP_ENDPOINT"] == receiver.url and got["OTEL_SERVICE_NAME"] is None
    named = {span.name: span for span in spans if span.name in ("claim", "run", "settle")}
    trace_id, delivery_span = delivery.split("-")[1:3]
    # Every span the runner exported is in the delivery's trace: the mcp SDK's spans of the
    # initialize, tools/list and claim_next calls, made outside any runner span, are dropped.
    assert {span.trace_id for span in spans} == {trace_id}, [(s.name, s.trace_id) for s in spans]
    assert "MCP send initialize" not in {span.name for span in spans}
    assert {span.parent_span_id for span in named.values()} == {delivery_span}
    # The mcp SDK's own client span of the complete nests under settle (and its request
    # carried that span's traceparent in _meta, which the server links to).
    (sent,) = [span for span in spans if span.name == "MCP send tools/call complete"]
    assert sent.parent_span_id == named["settle"].span_id
    # The agent continues the runner's run span, in the todo's trace.
    assert got["TRACEPARENT"] == f"00-{trace_id}-{named['run'].span_id}-01"
    assert named["run"].resource["service.name"] == "runner-under-test"
    assert named["run"].attributes == {"switchboard.todo_id": str(todo.pk),
                                       "switchboard.queue": "inbox"}
    assert named["settle"].attributes["switchboard.verb"] == "complete"
    todo.refresh_from_db()
    assert todo.state == "done"


def test_without_an_exporter_the_agent_gets_the_todos_own_traceparent(setup, runners,
                                                                       tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    delivery = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    Todo.objects.filter(pk=todo.pk).update(traceparent=delivery)
    seen = tmp_path / "seen"
    command = agent(tmp_path, "env", f"""
        import os
        open({str(seen)!r}, "w").write(os.environ.get("TRACEPARENT", "(none)"))
    """)
    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()
    assert seen.read_text() == delivery


@pytest.mark.parametrize("switch", [{"OTEL_TRACES_EXPORTER": "none"},
                                    {"OTEL_SDK_DISABLED": "true"}])
def test_traces_switched_off_export_nothing_and_say_so_at_start(setup, runners, tmp_path,
                                                                 switch):
    from tests.otlp_receiver import OtlpReceiver

    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    delivery = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    Todo.objects.filter(pk=todo.pk).update(traceparent=delivery)
    seen = tmp_path / "seen"
    command = agent(tmp_path, "env", f"""
        import os
        open({str(seen)!r}, "w").write(os.environ.get("TRACEPARENT", "(none)"))
    """)
    with OtlpReceiver() as receiver:
        runner = runners(url, credential, "--once", command=command,
                         env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **switch})
        assert runner.wait() == 0, runner.log_text()
        assert receiver.requests == 0  # the runner exported at exit, if ever
    ((name, value),) = switch.items()
    assert f'traces_off reason="{name}={value}"' in runner.log_text()
    assert seen.read_text() == delivery


@pytest.mark.parametrize("variable, value, supported", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "'http/protobuf'"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "'http/protobuf'"),
    ("OTEL_TRACES_EXPORTER", "zipkin", "'otlp'")])
def test_an_unsupported_trace_setting_stops_the_runner_with_one_line(tmp_path, variable, value,
                                                                     supported):
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update({TOKEN_ENV: "sbk_x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                variable: value})
    done = subprocess.run([sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x",
                           "--token-env", TOKEN_ENV, "--", "true"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"switchboard-runner: error: {variable}={value!r} is not supported")
    assert supported in line


def test_the_runner_says_why_traces_are_off_without_an_endpoint(monkeypatch, caplog):
    traces = load_runner_module("traces")
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # moot: nothing is exported
    with caplog.at_level("INFO", logger="switchboard.runner"):
        assert not traces.configure()
    assert caplog.messages == ['traces_off reason="OTEL_EXPORTER_OTLP_ENDPOINT is not set"']


def test_the_exporters_failures_are_logged_without_the_urls_query_or_userinfo(tmp_path):
    """In its own process: the runner makes its provider the global one."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on: the export is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(RUNNER_PACKAGE.parent)!r})
        logging.basicConfig(level=logging.WARNING)
        from switchboard_runner import traces
        assert traces.configure()
        with traces.span("hello", {{"id": 1, "queue": "inbox"}}):
            pass
        traces.shutdown()
    """)
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_TIMEOUT="5", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=(
        f"http://user:pass-word@127.0.0.1:{port}/v1/traces?api_key=SECRET-KEY"))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS)
    assert done.returncode == 0, done.stderr
    assert "opentelemetry.exporter" in done.stderr and "/v1/traces" in done.stderr
    assert "SECRET-KEY" not in done.stderr and "pass-word" not in done.stderr


def test_non_zero_exit_fails_with_the_exit_code_and_the_stderr_tail(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    command = agent(tmp_path, "boom", """
        import sys
        print("working", flush=True)
        print("traceback line\\nValueError: boom-marker", file=sys.stderr)
        sys.exit(3)
    """)
    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()

    todo.refresh_from_db()
    assert todo.state == "failed" and todo.retry_at is not None, runner.log_text()  # backoff
    # The line that names the error first, then how the agent ended and its stderr's end.
    assert todo.last_error.startswith("ValueError: boom-marker | agent exited with code 3: ")
    assert todo.last_error.endswith("traceback line ValueError: boom-marker")
    assert todo.result == {"exit_code": 3, "stdout_tail": "working\n",
                           "stderr_tail": "traceback line\nValueError: boom-marker\n"}
    assert completions(todo) == 0


def test_agent_past_max_runtime_is_killed_with_its_group_and_the_todo_failed(setup, runners,
                                                                             tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    pids = tmp_path / "pids"
    # The agent starts a grandchild in its group: killing "the agent" must take both.
    command = ["sh", "-c", f"sleep 300 & echo $$ $! > {pids}; wait"]
    runner = runners(url, credential, "--once", "--max-runtime", "1", command=command)
    assert runner.wait() == 0, runner.log_text()

    todo.refresh_from_db()
    assert todo.state == "failed"
    assert todo.last_error == "max runtime exceeded (1 s): agent killed"
    assert todo.result["exit_code"] == -signal.SIGTERM
    for pid in map(int, pids.read_text().split()):
        assert poll(lambda: not pid_alive(pid)), f"{pid} survived"
    assert "reason=max_runtime" in runner.log_text()


def pid_alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


AGENT_COMPLETES_ITSELF = """
    import asyncio, os
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async def main():
        token = os.environ["SWITCHBOARD_TOKEN"]
        http = create_mcp_http_client(headers={{"Authorization": f"Bearer {{token}}"}})
        async with http, Client(streamable_http_client(os.environ["SWITCHBOARD_URL"],
                                                       http_client=http), mode="legacy") as client:
            answer = await client.call_tool("{verb}", {{
                "todo_id": os.environ["SWITCHBOARD_TODO_ID"],
                "lease_id": os.environ["SWITCHBOARD_LEASE_ID"], {extra}}})
            assert not answer.is_error, answer

    asyncio.run(main())
    raise SystemExit({code})
"""


@pytest.mark.parametrize("verb, extra, exit_code, state", [
    ("complete", '"result": {"by": "agent"}', 0, "done"),
    ("fail", '"error": "agent says no"', 1, "failed"),
])
def test_agent_that_settles_the_todo_itself_is_left_alone(setup, runners, tmp_path, verb, extra,
                                                          exit_code, state):
    """The agent completes (exit 0) or fails (exit 1) its todo through its own MCP session
    with the lease_id: the runner's own settle is refused and it records nothing more."""
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    command = agent(tmp_path, "self", AGENT_COMPLETES_ITSELF.format(
        verb=verb, extra=extra, code=exit_code))
    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()

    todo.refresh_from_db()
    assert todo.state == state, runner.log_text()
    assert TodoEvent.objects.filter(todo=todo, action=verb).count() == 1
    if verb == "complete":
        assert todo.result == {"by": "agent"}  # the agent's, not overwritten by the runner's
    else:
        assert todo.last_error == "agent says no"
    log = runner.log_text()
    assert "completed todo_id" not in log and "failed todo_id" not in log
    assert "settled_by_agent" in log or "settle_refused" in log and "todo_state=ended" in log


def test_a_lost_lease_stops_the_agent_and_settles_nothing(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    started = tmp_path / "started"
    command = agent(tmp_path, "hang", f"""
        import os, time
        open({str(started)!r}, "a").write(f"{{os.getpid()}}\\n")
        time.sleep(300)
    """)
    runner = runners(url, credential, "--once", "--lease-seconds", "3", command=command)
    assert poll(started.exists), runner.log_text()
    first_agent = int(started.read_text().split()[0])
    # Someone else ends the lease (here: a release fenced by its lease_id, as an operator
    # override would): the runner's next heartbeat is refused and the agent is stopped.
    claimed = Todo.objects.get(pk=todo.pk)
    transitions.release_todo(transitions.Caller.operator(endpoint, "alice"), todo.pk,
                             lease_id=claimed.lease_id)
    runner.wait_log(f"stopping_agent todo_id={todo.pk} reason=lease_lost")
    assert poll(lambda: not pid_alive(first_agent))
    log = runner.log_text()
    assert f"lease_lost todo_id={todo.pk} code=lease_lost todo_state=" in log
    assert "failed todo_id" not in log and "completed todo_id" not in log


# -- crashes and signals ------------------------------------------------------------------------


def test_sigkilled_runner_loses_only_its_lease_and_a_second_runner_finishes_the_todo_once(
        setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    started = tmp_path / "started"
    hanging = agent(tmp_path, "hang", f"""
        import os, time
        open({str(started)!r}, "w").write(str(os.getpid()))
        time.sleep(300)
    """)
    first = runners(url, credential, "--lease-seconds", "2", "--wait-seconds", "0",
                    command=hanging)
    assert poll(started.exists), first.log_text()
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    # The orphaned agent is told to stop (PR_SET_PDEATHSIG) rather than work on unfenced.
    orphan = int(started.read_text())
    assert poll(lambda: not pid_alive(orphan))

    # The lease lapses (2 s); the reaper (Celery beat in production) returns the todo.
    def reaped():
        sweeps.expire_lapsed_leases()
        return Todo.objects.get(pk=todo.pk).state == "pending"

    assert poll(reaped, interval_seconds=0.2)

    second = runners(url, credential, "--once",
                     command=agent(tmp_path, "ok", "print('second runner did it')"))
    assert second.wait() == 0, second.log_text()
    todo.refresh_from_db()
    assert todo.state == "done" and todo.attempts == 2
    assert "second runner did it" in todo.result["stdout_tail"]
    assert completions(todo) == 1
    assert TodoEvent.objects.filter(todo=todo, action="lease_lapsed").count() == 1


def test_sigterm_stops_claiming_and_lets_the_running_agent_finish(setup, runners, tmp_path):
    endpoint, credential, url = setup
    first, second = make_todos(endpoint, 2)
    go = tmp_path / "go"
    started = tmp_path / "started"
    command = agent(tmp_path, "slow", f"""
        import os, time
        open({str(started)!r}, "w").write("x")
        while not os.path.exists({str(go)!r}):  # finishes only once the runner was told to stop
            time.sleep(0.05)
        print("finished after the signal")
    """)
    runner = runners(url, credential, "--wait-seconds", "0", "--grace-seconds", "30",
                     command=command)
    assert poll(started.exists), runner.log_text()
    runner.process.send_signal(signal.SIGTERM)
    runner.wait_log("stopping signal=SIGTERM")
    go.write_text("x")
    assert runner.wait() == 0, runner.log_text()

    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == "done" and "finished after the signal" in first.result["stdout_tail"]
    assert second.state == "pending" and second.attempts == 0  # never claimed after the stop


def test_sigterm_kills_and_fails_an_agent_that_outlives_the_grace_period(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    started = tmp_path / "started"
    command = ["sh", "-c", f"touch {started}; sleep 300"]
    runner = runners(url, credential, "--wait-seconds", "0", "--grace-seconds", "1",
                     command=command)
    assert poll(started.exists), runner.log_text()
    runner.process.send_signal(signal.SIGTERM)
    assert runner.wait() == 0, runner.log_text()

    todo.refresh_from_db()
    assert todo.state == "failed"
    assert todo.last_error == "runner stopped: agent killed after the 1 s grace period"


def test_a_second_signal_skips_the_grace_period(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    started = tmp_path / "started"
    runner = runners(url, credential, "--wait-seconds", "0", "--grace-seconds", "600",
                     command=["sh", "-c", f"touch {started}; sleep 300"])
    assert poll(started.exists), runner.log_text()
    runner.process.send_signal(signal.SIGTERM)
    runner.wait_log("stopping signal=SIGTERM")
    runner.process.send_signal(signal.SIGINT)
    assert runner.wait() == 0, runner.log_text()  # well before the 600 s grace
    todo.refresh_from_db()
    assert todo.state == "failed"
    assert todo.last_error == "runner stopped: agent killed at a second SIGINT"


# -- finding work -------------------------------------------------------------------------------


def test_a_doorbell_starts_the_agent_while_the_runner_idles(
        daphne_server, setup, runners, tmp_path):
    endpoint, credential, url = setup
    token = ingest_transitions.mint_operator_token(user=endpoint.owner, name="runner-test")[1]
    # No long poll and a long poll interval: only the doorbell can start the agent soon.
    runner, stamp = start_idle_runner(runners, url, credential, tmp_path, "--wait-seconds", "0",
                                      "--poll-seconds", str(FALLBACK_POLL_SECONDS))

    handed_at = time.time()
    todo_id = hand_over(daphne_server, endpoint, token)
    latency = stamp.seconds_after(handed_at, runner)
    assert latency < FALLBACK_POLL_SECONDS / 2, \
        f"agent started {latency:.2f} s after the hand-over\n{runner.log_text()}"
    assert "doorbell todo_id" in runner.log_text()
    assert poll(lambda: Todo.objects.get(pk=todo_id).state == "done")


def test_a_digest_wakes_the_idle_runner(setup, runners, tmp_path):
    """Clocking the endpoint back in sends a digest (§8); the runner drains with claim_next."""
    endpoint, credential, url = setup
    runner, stamp = start_idle_runner(runners, url, credential, tmp_path, "--wait-seconds", "0",
                                      "--poll-seconds", str(FALLBACK_POLL_SECONDS))
    endpoint_transitions.clock(endpoint, "out", reason="operator")
    # An operator's todo (push-eligible) handed over while out: no doorbell, it waits.
    ingest_transitions.hand_over_todo(endpoint=endpoint, operator=endpoint.owner, queue="ops",
                                      title="while you were out")
    clocked_in_at = time.time()
    endpoint_transitions.clock(endpoint, "in", reason="operator")
    assert stamp.seconds_after(clocked_in_at, runner) < FALLBACK_POLL_SECONDS / 2, \
        runner.log_text()
    assert "digest pending=1" in runner.log_text()
    assert "doorbell todo_id" not in runner.log_text()  # the digest woke it, not a ring


def hand_over(server, endpoint, token, title="rotate the keys"):
    answer = httpx.post(f"{server.url}/api/v1/endpoints/{endpoint.slug}/todos",
                        json={"queue": "ops", "title": title},
                        headers={"Authorization": f"Bearer {token}"}, timeout=DEADLINE_SECONDS)
    assert answer.status_code == 201, answer.text
    return answer.json()["todo"]["id"]


def test_doorbells_reach_the_runner_again_after_a_server_restart(start_daphne, runners, tmp_path):
    """The SDK stops reopening a dropped notification stream after two tries; the runner
    notices the stream is gone and reopens its session, so a restart longer than that does
    not silence doorbells for good."""
    server = start_daphne()
    owner = UserFactory(username="runner-restart")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="runner-restart", owner=owner)
    token = ingest_transitions.mint_operator_token(user=owner, name="runner-test")[1]
    runner, stamp = start_idle_runner(runners, f"{server.url}/mcp/{endpoint.slug}", credential,
                                      tmp_path, "--wait-seconds", "0",
                                      "--poll-seconds", str(FALLBACK_POLL_SECONDS))

    server.stop()
    runner.wait_log("stream_lost")  # the SDK has given up by now
    server.start()
    assert poll(lambda: runner.log_text().count("connected url=") >= 2), runner.log_text()
    assert poll(lambda: McpSession.objects.filter(endpoint=endpoint, open_streams__gt=0).exists())

    handed_at = time.time()
    hand_over(server, endpoint, token)
    assert stamp.seconds_after(handed_at, runner) < FALLBACK_POLL_SECONDS / 2, runner.log_text()
    assert "doorbell todo_id" in runner.log_text()


def test_idle_runner_claims_work_that_arrives_later(setup, runners, tmp_path):
    """New (unrung, unverified) work is found by the long poll."""
    endpoint, credential, url = setup
    runner = runners(url, credential, "--accept-unverified", "--wait-seconds", "2",
                     "--poll-seconds", "0.5", command=agent(tmp_path, "ok", "print('ok')"))
    runner.wait_log("idle")
    [todo] = make_todos(endpoint, 1, trust="unverified")
    assert poll(lambda: Todo.objects.get(pk=todo.pk).state == "done"), runner.log_text()


class NoLongPollProxy:
    """An HTTP proxy in front of the real server that plays a switchboard from before long
    poll: a claim_next carrying wait_seconds is refused with JSON-RPC -32602, as the old
    schema (additionalProperties: false) did; everything else is forwarded. It serves no
    notification stream (GET: 405), which the runner must survive too."""

    def __init__(self, upstream: str):
        import http.server
        import threading

        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(405)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                message = json.loads(body)
                params = message.get("params") or {}
                if (message.get("method") == "tools/call" and params.get("name") == "claim_next"
                        and "wait_seconds" in (params.get("arguments") or {})):
                    proxy.refused += 1
                    self.answer(200, {"Content-Type": "application/json"}, json.dumps({
                        "jsonrpc": "2.0", "id": message["id"], "error": {
                            "code": -32602, "message": "Invalid params for claim_next: "
                            "Additional properties are not allowed ('wait_seconds' was unexpected)"}
                    }).encode())
                    return
                self.forward("POST", body)

            def do_DELETE(self):
                self.forward("DELETE", b"")

            def forward(self, method, body):
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "accept")}
                headers["Accept"] = "application/json, text/event-stream"
                got = httpx.request(method, upstream + self.path, content=body, headers=headers,
                                    timeout=DEADLINE_SECONDS)
                self.answer(got.status_code, {k: v for k, v in got.headers.items() if k.lower()
                                              in ("content-type", "mcp-session-id")}, got.content)

            def answer(self, status, headers, content):
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.refused = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_against_a_server_without_long_poll_the_runner_falls_back_to_short_polls(
        daphne_server, setup, runners, tmp_path):
    endpoint, credential, _ = setup
    proxy = NoLongPollProxy(daphne_server.url)
    try:
        runner = runners(f"{proxy.url}/mcp/{endpoint.slug}", credential, "--wait-seconds", "30",
                         "--poll-seconds", "0.5", command=agent(tmp_path, "ok", "print('ok')"))
        runner.wait_log("long_poll_unavailable")
        runner.wait_log("idle")
        [todo] = make_todos(endpoint, 1)
        assert poll(lambda: Todo.objects.get(pk=todo.pk).state == "done"), runner.log_text()
        assert proxy.refused == 1  # asked once, then never again
    finally:
        proxy.close()


def assert_long_polls(runner):
    assert "long_poll_unavailable" not in runner.log_text(), runner.log_text()


def test_long_poll_starts_the_agent_without_a_doorbell_or_a_poll(setup, runners, tmp_path):
    endpoint, credential, url = setup
    runner, stamp = start_idle_runner(runners, url, credential, tmp_path, "--accept-unverified",
                                      "--wait-seconds", "2",
                                      "--poll-seconds", str(FALLBACK_POLL_SECONDS))
    assert_long_polls(runner)
    created_at = time.time()
    # Unverified: never rung, so only the long poll can find it soon.
    make_todos(endpoint, 1, trust="unverified")
    assert stamp.seconds_after(created_at, runner) < FALLBACK_POLL_SECONDS / 2, runner.log_text()


def test_sigterm_ends_a_waiting_long_poll_while_agents_finish(setup, runners, tmp_path):
    """A stop while one agent runs and the runner long-polls for a second: the abandoned long
    poll must not claim a todo that arrives during the grace period (nobody would run it)."""
    endpoint, credential, url = setup
    [first] = make_todos(endpoint, 1)
    go, started = tmp_path / "go", tmp_path / "started"
    command = agent(tmp_path, "slow", f"""
        import os, time
        open({str(started)!r}, "w").write("x")
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
    """)
    runner = runners(url, credential, "--concurrency", "2", "--wait-seconds", "60",
                     command=command)
    # The second claim (a long poll: one slot is free) went out right after the first claim,
    # before the agent started.
    assert poll(started.exists), runner.log_text()
    assert_long_polls(runner)
    runner.process.send_signal(signal.SIGTERM)
    runner.wait_log("stopping signal=SIGTERM")
    # The runner abandons the long poll by reopening its session: once it has connected again,
    # the old session's requests are closed (before that, a todo could still be handed to the
    # waiting call: the stop and the arrival at the same instant).
    assert poll(lambda: runner.log_text().count("connected url=") >= 2), runner.log_text()
    [late] = make_todos(endpoint, 1)
    # Had the abandoned long poll stayed open, the server would hand it this todo at once.
    assert not poll(lambda: Todo.objects.get(pk=late.pk).state != "pending", 2.0)
    go.write_text("x")
    assert runner.wait() == 0, runner.log_text()
    assert Todo.objects.get(pk=first.pk).state == "done"
    assert Todo.objects.get(pk=late.pk).state == "pending"


def test_concurrency_two_never_runs_three_agents(setup, runners, tmp_path):
    endpoint, credential, url = setup
    todos = make_todos(endpoint, 6)
    spans, starts = tmp_path / "spans", tmp_path / "starts"
    # Each agent runs until a second one has started (the first two therefore overlap, however
    # slowly the machine starts them), then a little longer: a runner that let a third start
    # while two run would show three spans covering one instant.
    command = agent(tmp_path, "span", f"""
        import os, time
        start = time.time()
        with open({str(starts)!r}, "a") as out:
            out.write("x")
        deadline = start + {DEADLINE_SECONDS}
        while os.path.getsize({str(starts)!r}) < 2 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        with open({str(spans)!r}, "a") as out:
            out.write(f"{{start}} {{time.time()}}\\n")
    """)
    runner = runners(url, credential, "--once", "--concurrency", "2", command=command)
    assert runner.wait() == 0, runner.log_text()

    assert all(Todo.objects.get(pk=t.pk).state == "done" for t in todos)
    intervals = [tuple(map(float, line.split())) for line in spans.read_text().splitlines()]
    assert len(intervals) == 6
    most = max(sum(1 for start, end in intervals if start <= at < end) for at, _ in intervals)
    assert most == 2, intervals


def test_queues_limits_what_the_runner_claims(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [wanted] = make_todos(endpoint, 1, queue="reviews")
    [other] = make_todos(endpoint, 1, queue="inbox")
    runner = runners(url, credential, "--once", "--queues", "reviews,triage",
                     command=["true"])
    assert runner.wait() == 0, runner.log_text()
    assert Todo.objects.get(pk=wanted.pk).state == "done"
    assert Todo.objects.get(pk=other.pk).state == "pending"


def test_queues_outside_the_scope_stop_the_runner_instead_of_retrying(daphne_server, runners):
    owner = UserFactory(username="runner-scoped")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="runner-scoped", owner=owner,
                                                              scope=["inbox"])
    runner = runners(f"{daphne_server.url}/mcp/{endpoint.slug}", credential,
                     "--queues", "payroll", command=["true"])
    assert runner.wait() == 1, runner.log_text()
    assert "claim_refused code=not_in_scope" in runner.log_text()


def test_dry_run_lists_pending_work_and_the_command_without_claiming(setup, runners):
    endpoint, credential, url = setup
    todos = make_todos(endpoint, 2)
    runner = runners(url, credential, "--dry-run", command=["echo", "do {todo_id}: {title}"])
    assert runner.wait() == 0, runner.log_text()
    out = runner.process.stdout.read()
    for todo in todos:
        assert f"echo 'do {todo.pk}: {todo.title}'" in out
        todo.refresh_from_db()
        assert todo.state == "pending" and todo.attempts == 0
    assert "nothing claimed" in out


# -- the command line and the client boundary ----------------------------------------------


def test_bad_invocations_exit_2_before_touching_the_server(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}

    def run(*argv):
        return subprocess.run([sys.executable, str(RUNNER), *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=DEADLINE_SECONDS)

    no_token = run("--url", "http://127.0.0.1:9/mcp/x", "--token-env", TOKEN_ENV, "--", "true")
    assert no_token.returncode == 2 and TOKEN_ENV in no_token.stderr
    no_command = run("--url", "http://127.0.0.1:9/mcp/x")
    assert no_command.returncode == 2 and "agent command" in no_command.stderr
    env[TOKEN_ENV] = "sbk_x"
    missing = run("--url", "http://127.0.0.1:9/mcp/x", "--token-env", TOKEN_ENV, "--",
                  "no-such-agent-binary")
    assert missing.returncode == 2 and "no-such-agent-binary" in missing.stderr
    for shebang in ("#!/nonexistent/interpreter", "#!/usr/bin/env sb-no-such-interpreter -u"):
        script = tmp_path / "agent-without-interpreter"
        script.write_text(f"{shebang}\n")
        script.chmod(0o755)
        no_interpreter = run("--url", "http://127.0.0.1:9/mcp/x", "--token-env", TOKEN_ENV, "--",
                             str(script))
        assert no_interpreter.returncode == 2, no_interpreter.stderr
        assert "interpreter" in no_interpreter.stderr, no_interpreter.stderr
    too_long = run("--url", "http://x/mcp/x", "--token-env", TOKEN_ENV, "--wait-seconds", "61",
                   "--", "true")
    assert too_long.returncode == 2


def test_runner_imports_only_the_mcp_sdk_and_the_standard_library():
    roots = set()
    for source in [RUNNER, *RUNNER_PACKAGE.glob("*.py")]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots.add(node.module.split(".")[0])
    # pydantic arrives with the SDK (its models are pydantic); it is not a separate install.
    # opentelemetry: its API arrives with the SDK too; the runner imports the OpenTelemetry
    # SDK and exporter only from its optional ``traces`` extra, and only when configured.
    assert roots - set(sys.stdlib_module_names) == {"mcp", "pydantic", "switchboard_runner",
                                                    "opentelemetry"}
    def pins(path):
        return [line.strip() for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    root_mcp = [pin for pin in pins(REPO_ROOT / "requirements.txt") if pin.startswith("mcp==")]
    assert pins(REPO_ROOT / "runner" / "requirements.txt") == root_mcp
    project = tomllib.loads((REPO_ROOT / "runner" / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == root_mcp


def test_agent_arguments_substitute_only_the_three_placeholders():
    runner = load_runner_module()
    todo = {"id": "7", "title": "fix {it}", "lease_id": "L"}
    argv = runner.agent_argv(["-p", "Todo {todo_id}: {title} {todo_json} {x}"], todo)
    assert argv == ["-p", f"Todo 7: fix {{it}} {json.dumps(todo)} {{x}}"]


def test_placeholders_inside_a_todo_are_text_not_substituted_again():
    runner = load_runner_module()
    todo = {"id": "7", "title": 'say "hi" to {title} {todo_json}', "payload": {"x": "{todo_id}"}}
    json_arg, title_arg = runner.agent_argv(["{todo_json}", "{title}"], todo)
    assert json.loads(json_arg) == todo
    assert title_arg == todo["title"]


def test_tail_keeps_the_last_bytes_and_drops_nul():
    runner = load_runner_module()
    tail = runner.Tail(limit=10)
    for chunk in (b"0123456789", b"abc\x00", b"defgh"):
        tail.add(chunk)
    assert tail.text() == "9abcdefgh"  # the last 10 bytes, NUL removed


# -- a sender's title where an option parser looks --------------------------------------------


@pytest.mark.parametrize("command, refused", [
    (["agent", "{title}"], "argument 1"),
    (["agent", "--model", "m", "{title} (from the board)"], "argument 3"),
    (["{title}"], "the program"),
    (["/opt/agents/{todo_id}"], "the program"),
])
def test_a_command_where_the_title_could_read_as_an_option_is_refused_at_start(
        tmp_path, command, refused):
    """An operator's title ``--dangerously-skip-permissions`` would be the agent's first
    option under ``agent '{title}'``: such a command exits 2 before touching the server,
    naming the argument and both ways to write it."""
    env = {**os.environ, TOKEN_ENV: "sbk_x"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "agent").write_text("#!/bin/sh\n")
    (bin_dir / "agent").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = subprocess.run([sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x",
                             "--token-env", TOKEN_ENV, "--dry-run", "--", *command],
                            env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=DEADLINE_SECONDS)
    assert result.returncode == 2, result.stderr
    assert refused in result.stderr, result.stderr
    if refused != "the program":
        assert "after '--'" in result.stderr and "--title={title}" in result.stderr


@pytest.mark.parametrize("lead", ["{kind}", "{lease_id}"])
def test_a_prompt_file_starting_with_a_kind_is_refused_where_the_prompt_starts_an_argument(
        tmp_path, lead):
    """A kind (the sender's event name) or a lease id may start with "-": a prompt file that
    starts with one makes ``{prompt}`` an option under ``agent '{prompt}'``. Refused at start
    (exit 2) naming the argument and the placeholder; taken where no option parser reads it."""
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(f"{lead} arrived: handle todo {{todo_id}}\n")
    env = {**os.environ, TOKEN_ENV: "sbk_x"}

    def start(*command):
        return subprocess.run(
            [sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x", "--token-env",
             TOKEN_ENV, "--prompt-file", str(prompt_file), "--dry-run", "--", *command],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=DEADLINE_SECONDS)

    for command in (["sh", "{prompt}"], ["sh", "-c", "cat", "{prompt} (more)"]):
        refused = start(*command)
        assert refused.returncode == 2, refused.stderr
        assert "starts with {prompt}" in refused.stderr and lead in refused.stderr, refused.stderr
    runner = load_runner_module()
    template = prompt_file.read_text()
    for command in (["agent", "--", "{prompt}"], ["agent", "--prompt={prompt}"]):
        assert runner.misplaced_command_placeholder(command, template) is None, command
    for safe in ("{todo_id} arrived", "{queue}: todo {todo_id}", "Todo {kind}"):
        assert runner.misplaced_command_placeholder(["agent", "{prompt}"], safe) is None, safe


def test_the_title_is_taken_after_a_double_dash_or_inside_an_options_value():
    runner = load_runner_module()
    for command in (["agent", "--", "{title}"], ["agent", "--title={title}"],
                    ["agent", "-p", "{prompt}", "{todo_json}", "{todo_id}"],
                    ["agent", "--note", "todo: {title}"]):
        assert runner.misplaced_command_placeholder(command) is None, command


def test_a_title_that_looks_like_an_option_reaches_the_agent_as_text_after_double_dash(
        setup, runners, tmp_path):
    endpoint, credential, url = setup
    todo = transitions.create_todo(endpoint=endpoint, queue="inbox", actor="operator",
                                   title="--dangerously-skip-permissions", trust="operator")[0]
    seen = tmp_path / "argv.json"
    recorder = agent(tmp_path, "recorder", f"""
        import json, sys
        open({str(seen)!r}, "w").write(json.dumps(sys.argv[1:]))
    """)
    runner = runners(url, credential, "--once", command=[*recorder, "--", "{title}"])
    assert runner.wait() == 0, runner.log_text()
    assert json.loads(seen.read_text()) == ["--", "--dangerously-skip-permissions"]
    todo.refresh_from_db()
    assert todo.state == "done"


# -- usage (docs/runner.md#usage) ------------------------------------------------------------------


USAGE_AGENT = """
    import json, os, sys
    with open(os.environ["SWITCHBOARD_USAGE_FILE"], "w") as out:
        json.dump({usage!r}, out)
    sys.exit({code})
"""


@pytest.mark.parametrize("code,state", [(0, "done"), (3, "failed")])
def test_the_usage_file_the_agent_writes_goes_with_complete_and_fail(setup, runners, tmp_path,
                                                                    code, state):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    usage = {"input_tokens": 1500, "output_tokens": 300, "cost_usd": 0.25, "turns": 4,
             "model": "local-llm"}
    command = agent(tmp_path, "spender", USAGE_AGENT.format(usage=usage, code=code))
    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == state, runner.log_text()
    assert queries.todo_as_dict(todo)["usage"] == usage


@pytest.mark.parametrize("written,logged", [
    ({"tokens": 5}, "usage_file_ignored"),  # not a usage report: the runner drops it
    ({"cost_usd": -1}, "usage_refused"),  # out of range: the server refuses, the runner retries
])
def test_a_bad_usage_file_never_costs_the_settle(setup, runners, tmp_path, written, logged):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    command = agent(tmp_path, "bad-usage", USAGE_AGENT.format(usage=written, code=0))
    runner = runners(url, credential, "--once", command=command)
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "done" and todo.usage_reports == 0, runner.log_text()
    assert logged in runner.log_text()


def test_cli_reports_are_recognized_by_their_flags_and_parsed():
    usage = load_runner_module("usage")
    assert usage.report_format(["claude", "-p", "x", "--output-format", "json"]) == "claude"
    assert usage.report_format(["/bin/claude", "-p", "x", "--output-format=json"]) == "claude"
    assert usage.report_format(["claude", "-p", "x", "--output-format", "stream-json"]) is None
    assert usage.report_format(["codex", "exec", "--json", "x"]) == "codex"
    assert usage.report_format(["codex", "exec", "x"]) is None
    assert usage.report_format(["gemini", "-p", "x", "-o", "json"]) == "gemini"
    assert usage.report_format(["./handle-todo"]) is None
    claude = usage.read_report("claude", json.dumps({
        "type": "result", "subtype": "success", "is_error": False, "result": "did it",
        "total_cost_usd": 0.0123, "num_turns": 3,
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 5,
                  "cache_read_input_tokens": 100, "output_tokens": 7},
        "modelUsage": {"claude-haiku": {"outputTokens": 1}, "claude-sonnet": {"outputTokens": 6}}}))
    assert (claude.ok, claude.text) == (True, "did it")
    assert claude.usage == {"input_tokens": 115, "output_tokens": 7, "turns": 3,
                            "cost_usd": 0.0123, "model": "claude-sonnet"}
    codex = usage.read_report("codex", "\n".join(json.dumps(event) for event in (
        {"type": "thread.started"},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "done"}},
        {"type": "turn.completed", "usage": {"input_tokens": 50, "output_tokens": 5}},
        {"type": "turn.completed", "usage": {"input_tokens": 60, "output_tokens": 6}})))
    assert (codex.ok, codex.text) == (True, "done")
    assert codex.usage == {"input_tokens": 110, "output_tokens": 11, "turns": 2}
    failed = usage.read_report("codex", json.dumps(
        {"type": "turn.failed", "error": {"message": "quota"}}))
    assert (failed.ok, failed.text) == (False, "quota")
    gemini = usage.read_report("gemini", json.dumps({"response": "ok", "stats": {"models": {
        "flash-lite": {"api": {"totalRequests": 1}, "tokens": {"prompt": 9, "candidates": 1},
                       "roles": {"utility_router": {}}},
        "pro": {"api": {"totalRequests": 2}, "tokens": {"prompt": 90, "candidates": 10,
                                                        "thoughts": 4}, "roles": {"main": {}}}}}}))
    assert gemini.usage == {"input_tokens": 99, "output_tokens": 15, "turns": 3, "model": "pro"}
    assert usage.read_report("claude", "not json at all").ok is None
