"""Benchmark: a delivery's 202 → its acknowledgement at the source (👀, or Linear's ``thought``),
per source, on the embedded default and in production (docs/write-back.md#the-outbox).

    DATABASE_URL=postgres://… REDIS_URL=redis://… python bench/write_back.py [--deliveries 200] \
        [--sources github,…]

For each mode, a child process starts the sources' stand-ins (ingest/tests/*_standin.py, the
same ones the tests hold to each provider's published description), makes per source an
endpoint, a webhook with a connection to the stand-in and a route with ``--write-back ack``,
then starts switchboard for real:

* embedded — ``manage.py serve`` with no DATABASE_URL and no REDIS_URL: SQLite and the
  in-process scheduler, which a commit wakes;
* production — ``daphne switchboard.asgi:application`` and one ``celery -A switchboard worker``
  on DATABASE_URL and REDIS_URL: a commit enqueues the send task.

``--deliveries`` signed deliveries per source are POSTed one after another; for each, the clock
runs from the 202 to the moment the stand-in has the acknowledgement. Prints p50/p99/max per
source and mode (target: p99 under 5 s; goal: under 1 s). Both run with the settings that let
write-back reach a stand-in on loopback http (tests/system/write_back_settings.py).

A benchmark, not a test: nothing here asserts a speed.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
from bench.modes import percentile, run_children  # noqa: E402

SETTINGS = "tests.system.write_back_settings"
os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")
UNTHROTTLED = {"SWITCHBOARD_INGEST_RATE_PER_MINUTE": "100000000", "LOG_LEVEL": "WARNING",
               "PYTHONUNBUFFERED": "1"}
WEBHOOK_SECRET = "bench-write-back-secret-0123456789"
ACK_DEADLINE_SECONDS = 30.0


def headers_of(meta: dict) -> dict:
    """ingest/tests/signing.py's test-client META keys as HTTP headers."""
    return {key.removeprefix("HTTP_").replace("_", "-"): value for key, value in meta.items()}


class GitHub:
    """An ``issues.opened`` delivery of GitHub's own example payload; the ack is 👀 on it."""

    source, kind = "github", "github_token"

    def __init__(self):
        from ingest.tests.github_standin import GitHubStandIn

        self.standin = GitHubStandIn().start()
        self.secret = self.standin.token

    def delivery(self, number: int) -> tuple[bytes, dict]:
        from ingest.tests import signing
        from ingest.tests.github_standin import webhook_example

        payload = webhook_example("issues", action="opened")
        payload["issue"]["number"] = number
        payload.pop("installation", None)
        body = json.dumps(payload).encode()
        return body, {**headers_of(signing.github(WEBHOOK_SECRET, body)),
                      "Content-Type": "application/json"}

    def acked(self, number: int) -> bool:
        return any(reaction["subject"][3] == str(number) and reaction["content"] == "eyes"
                   for reaction in list(self.standin.reactions))

    def problems(self) -> list:
        return self.standin.problems


class _Forge:
    """GitLab and Gitea/Forgejo: an issue opened, as the tests build it after each source's
    webhook reference (ingest/tests/test_write_back_forges.py); the ack is 👀 on the issue."""

    source = kind = ""

    def delivery(self, number: int) -> tuple[bytes, dict]:
        from ingest.tests import signing

        event, payload = self.issue(number)
        body = json.dumps(payload).encode()
        sign = getattr(signing, self.source)
        return body, {**headers_of(sign(WEBHOOK_SECRET, body, event=event)),
                      "Content-Type": "application/json"}

    def problems(self) -> list:
        return self.standin.problems


class GitLab(_Forge):
    source = kind = "gitlab"

    def __init__(self):
        from ingest.tests.gitlab_standin import GitLabStandIn

        self.standin = GitLabStandIn().start()
        self.secret = self.standin.token

    def issue(self, number):
        from ingest.tests.test_write_back_forges import gitlab_issue

        return gitlab_issue(iid=number)

    def acked(self, number: int) -> bool:
        return any(award["on"][1:] == ("issues", number, None) and award["name"] == "eyes"
                   for award in list(self.standin.awards))


class Gitea(_Forge):
    source = kind = "gitea"

    def __init__(self):
        from ingest.tests.gitea_standin import GiteaStandIn

        self.standin = GiteaStandIn().start()
        self.secret = self.standin.token

    def issue(self, number):
        from ingest.tests.test_write_back_forges import gitea_issue

        return gitea_issue(number=number)

    def acked(self, number: int) -> bool:
        return any(reaction["on"][2:] == ("issue_post_issue_reaction", number)
                   and reaction["content"] == "eyes"
                   for reaction in list(self.standin.reactions))


class Slack:
    """A person's message in a channel, as the tests build Slack's event_callback
    (ingest/tests/test_write_back_slack.py); the ack is reactions.add eyes on it."""

    source = kind = "slack"

    def __init__(self):
        from ingest.tests.slack_standin import SlackStandIn

        self.standin = SlackStandIn().start()
        self.secret = self.standin.token
        self.messages = {}  # delivery number -> the message's ts

    def delivery(self, number: int) -> tuple[bytes, dict]:
        from ingest.tests import signing
        from ingest.tests.test_write_back_slack import person_says

        payload = person_says(self.standin, text=f"please look at {number}")
        self.messages[number] = payload["event"]["ts"]
        body = json.dumps(payload).encode()
        return body, {**headers_of(signing.slack(WEBHOOK_SECRET, body)),
                      "Content-Type": "application/json"}

    def acked(self, number: int) -> bool:
        ts = self.messages[number]
        return any(reaction[1] == ts and reaction[2] == "eyes"
                   for reaction in list(self.standin.reactions))

    def problems(self) -> list:
        return self.standin.problems


class Linear:
    """An AgentSessionEvent ``created``, as the tests build it after Linear's schema
    (ingest/tests/test_write_back_linear.py); the ack is the session's first ``thought``, which
    Linear wants within 10 s."""

    source = kind = "linear"

    def __init__(self):
        from ingest.tests.linear_standin import OAUTH_TOKEN, LinearStandIn

        self.standin = LinearStandIn().start()
        self.secret = OAUTH_TOKEN
        self.sessions = {}  # delivery number -> the agent session's id

    def delivery(self, number: int) -> tuple[bytes, dict]:
        from ingest.tests import signing
        from ingest.tests.test_write_back_linear import session_event

        payload = session_event(self.standin)
        self.sessions[number] = payload["agentSession"]["id"]
        body = signing.linear_body(payload)
        return body, {**headers_of(signing.linear(WEBHOOK_SECRET, body, event=payload["type"])),
                      "Content-Type": "application/json"}

    def acked(self, number: int) -> bool:
        return any(activity["content"].get("type") == "thought"
                   for activity in self.standin.activities_of(self.sessions[number]))

    def problems(self) -> list:
        return self.standin.problems


SOURCES = {"github": GitHub, "gitlab": GitLab, "gitea": Gitea, "slack": Slack, "linear": Linear}


def prepare(source, run_id: str) -> str:
    """An endpoint, a webhook of ``source`` writing back under a connection to its stand-in,
    and a route with ``--write-back ack``. Returns the webhook's slug."""
    from django.contrib.auth import get_user_model

    from endpoints import transitions as endpoint_transitions
    from ingest import connections
    from ingest import transitions as ingest_transitions

    owner, _ = get_user_model().objects.get_or_create(username=f"bench-wb-{run_id}")
    endpoint, _ = endpoint_transitions.vend_endpoint(slug=f"wb-{source.source}-{run_id}",
                                                     owner=owner)
    connection, test = connections.create_connection(
        name=f"wb-{source.source}-{run_id}", owner=owner, kind=source.kind, secret=source.secret,
        api_url=source.standin.api_url)
    if not test.ok:
        raise RuntimeError(f"{source.source}: the connection test failed: {test.error}")
    webhook, _ = ingest_transitions.create_webhook(
        slug=f"wb-{source.source}-{run_id}", owner=owner, source=source.source,
        secret=WEBHOOK_SECRET, connection=connection)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                         write_back="ack")
    return webhook.slug


def start(mode: str, port: int, log_dir: Path) -> list:
    env = {**os.environ, **UNTHROTTLED}
    if mode == "embedded":
        commands = [("serve", [sys.executable, "manage.py", "serve", "--port", str(port)])]
    else:
        commands = [("daphne", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                "switchboard.asgi:application"]),
                    ("worker", [sys.executable, "-m", "celery", "-A", "switchboard", "worker",
                                "--concurrency", "2", "--without-gossip", "--without-mingle",
                                "--loglevel", "WARNING"])]
    processes = []
    for name, command in commands:
        log = open(log_dir / f"{mode}-{name}.log", "wb")
        processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    return processes


def wait_ready(url: str, processes, deadline_seconds: float = 120.0):
    import httpx

    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a server process exited")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server not ready")


def measure(url: str, hook_slug: str, source, deliveries: int, warmup: int) -> list[float]:
    import httpx

    latencies = []
    with httpx.Client(timeout=30) as http:
        for index in range(warmup + deliveries):
            number = 10_000 + index
            body, headers = source.delivery(number)
            answer = http.post(f"{url}/hooks/{hook_slug}", content=body, headers=headers)
            accepted = time.perf_counter()
            if answer.status_code != 202:
                raise RuntimeError(f"{source.source}: {answer.status_code} {answer.text[:300]}")
            while not source.acked(number):
                if time.perf_counter() - accepted > ACK_DEADLINE_SECONDS:
                    raise RuntimeError(f"{source.source}: no ack for delivery {number}")
                time.sleep(0.001)
            if index >= warmup:
                latencies.append(time.perf_counter() - accepted)
    return latencies


def child(mode: str, names: list[str], deliveries: int, warmup: int):
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    run_id = uuid.uuid4().hex[:8]
    sources = [SOURCES[name]() for name in names]
    hooks = [prepare(source, run_id) for source in sources]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-write-back-logs-") as logs:
        processes = start(mode, port, Path(logs))
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, processes)
            result = {source.source: measure(url, hook, source, deliveries, warmup)
                      for source, hook in zip(sources, hooks)}
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
    problems = [problem for source in sources for problem in source.problems()]
    print(json.dumps({"latencies": result, "problems": problems}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--child", choices=["embedded", "production"])
    args = parser.parse_args()
    names = [name for name in args.sources.split(",") if name]
    if args.child:
        child(args.child, names, args.deliveries, args.warmup)
        return
    if not os.environ.get("DATABASE_URL", "").startswith("postgres") or not os.environ.get(
            "REDIS_URL"):
        sys.exit("bench/write_back.py runs production on PostgreSQL + Redis: set "
                 "DATABASE_URL=postgres://… and REDIS_URL=redis://…")
    results = run_children(str(Path(__file__).resolve()), "production", [
        "--deliveries", str(args.deliveries), "--warmup", str(args.warmup),
        "--sources", ",".join(names)])
    print(f"switchboard bench/write_back.py — {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.deliveries} signed "
          f"deliveries one at a time (+{args.warmup} warm-up) per source and mode; 202 → the "
          "stand-in has the ack\n")
    print("| mode | source | p50 | p99 | max |")
    print("| --- | --- | --- | --- | --- |")
    for mode, result in results.items():
        for name, latencies in result["latencies"].items():
            print(f"| {mode} | {name} | {percentile(latencies, .5) * 1000:.0f} ms | "
                  f"{percentile(latencies, .99) * 1000:.0f} ms | {max(latencies) * 1000:.0f} ms |")
        if result["problems"]:
            print(f"\n{mode}: requests the stand-ins found outside the providers' descriptions: "
                  f"{result['problems'][:5]}")
    print("\ntarget: p99 under 5 s; goal: under 1 s")


if __name__ == "__main__":
    main()
