"""The runner never hands over its credential (docs/runner.md#the-runners-credential).

Against a real daphne on PostgreSQL + Redis, the runner and a probing agent run as unprivileged
users under ``setpriv`` (the tests run as root; without it they are skipped saying so):

* Same user (``nobody`` both): the agent finds the endpoint credential neither in its own
  environment (which holds its todo's own token) nor in the runner's ``/proc/<pid>/environ``
  (the initial environment, which still holds it), ``mem``, ``maps`` or ``fd``: the runner is
  non-dumpable. Its ``cmdline`` is readable and does not hold it.
* The separate-user recipe: the runner as ``nobody`` with ``--token-file``, the agent started
  through ``setpriv`` as another user: the file is out of its reach too.
* ``--token-file`` works; an empty one is refused (exit 2).
* ``--repo-token-env``: the agent gets a repository token (the GitHub stand-in mints it for the
  todo's repository with the route's permissions) and a 0600 file the runner rewrites with a
  fresh one before it runs out; without a grant, one log line and the agent runs without.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from datetime import datetime, timedelta, timezone as dt_timezone
from pathlib import Path

import pytest

from endpoints import transitions as endpoint_transitions
from ingest.tests.conftest import SECRETS, forget_found_slugs, github  # noqa: F401
from tests.factories import UserFactory
from tests.processes import DEADLINE_SECONDS
from tests.servers import start_daphne  # noqa: F401
from test_runner import (RUNNER, agent, load_runner_module, make_todos, runners,  # noqa: F401
                         setup)

pytestmark = pytest.mark.django_db(transaction=True)

NOBODY = ("--reuid=nobody", "--regid=nogroup", "--clear-groups")
# A user of its own for the agent: no account needed, only a uid nobody else runs as.
AGENT_UID = 65533

# Reads what a same-user (or other-user) process may try, and keeps each answer in OUT:
# ``<name>.bytes`` when it could read, ``<name>.denied`` with the error when it could not.
PROBE = """
    import json, os, sys
    out, credential_file = sys.argv[1], sys.argv[2]
    runner = os.getppid()

    def keep(name, read):
        try:
            data = read()
        except OSError as error:
            with open(os.path.join(out, name + ".denied"), "w") as f:
                f.write(f"{type(error).__name__}: {error.strerror}")
            return
        with open(os.path.join(out, name + ".bytes"), "wb") as f:
            f.write(data)

    def whole(path):
        return lambda: open(path, "rb").read()

    def memory():
        # The readable mappings, as a debugger or a same-user attacker would dump them.
        dump = b""
        with open(f"/proc/{runner}/maps") as maps, open(f"/proc/{runner}/mem", "rb") as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if not perms.startswith("r"):
                    continue
                start, end = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(start)
                    dump += mem.read(min(end - start, 64 << 20))
                except (OSError, OverflowError, ValueError):
                    continue
        return dump

    def descriptors():
        return b"\\n".join(open(f"/proc/{runner}/fd/{n}", "rb").read(1 << 16)
                          for n in os.listdir(f"/proc/{runner}/fd") if n not in ("0", "1", "2"))

    keep("environ", whole(f"/proc/{runner}/environ"))
    keep("cmdline", whole(f"/proc/{runner}/cmdline"))
    keep("status", whole(f"/proc/{runner}/status"))
    keep("maps", whole(f"/proc/{runner}/maps"))
    keep("mem", memory)
    keep("fd", descriptors)
    keep("credential_file", whole(credential_file))
    keep("self_environ", whole("/proc/self/environ"))
    keep("stdin", sys.stdin.buffer.read)
    with open(os.path.join(out, "whoami"), "w") as f:
        json.dump({"uid": os.getuid(), "env": dict(os.environ)}, f)
"""


@pytest.fixture
def shared_dir():
    """A directory both unprivileged users can enter (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="sb-creds-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def python_for_nobody():
    """``(interpreter, env)`` that ``nobody`` can run the runner with: this one, or (when it
    lives where nobody may enter, as a pyenv under /root does) the system's Python 3 with this
    environment's packages on its path."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv(1) to run the runner and its agent as "
                    "unprivileged users")
    packages = os.pathsep.join(sorted({sysconfig.get_paths()[key]
                                       for key in ("purelib", "platlib")}))
    for python, env in ((sys.executable, {}),
                        ("/usr/bin/python3", {"PYTHONPATH": packages})):
        # The runner looks its agent command up as the user it runs as (which()).
        check = subprocess.run(["setpriv", *NOBODY, python, "-c",
                                f"import mcp, shutil; assert shutil.which({python!r})"],
                               env={**os.environ, **env}, capture_output=True,
                               timeout=DEADLINE_SECONDS, cwd="/")
        if check.returncode == 0:
            return python, env
    pytest.skip("no Python with the mcp package that nobody may run")


def probe_command(python: str, shared_dir: Path,
                  credential_file: Path) -> tuple[list[str], Path]:
    script = shared_dir / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    script.chmod(0o755)
    out = shared_dir / "out"
    out.mkdir()
    out.chmod(0o777)
    return [python, str(script), str(out), str(credential_file)], out


def credential_file_for(owner_uid: int, credential: str, shared_dir: Path) -> Path:
    """The credential in a 0600 file in a 0700 directory, both ``owner_uid``'s."""
    private = shared_dir / "private"
    private.mkdir(mode=0o700)
    path = private / "credential"
    path.write_text(credential + "\n")
    path.chmod(0o600)
    for each in (private, path):
        os.chown(each, owner_uid, -1)
    return path


def findings(out: Path, credential: str) -> dict:
    """Per probe: ``denied: …``, ``found`` (the credential was in what it read) or ``clean``."""
    seen = {}
    for path in sorted(out.iterdir()):
        if path.suffix == ".denied":
            seen[path.stem] = "denied: " + path.read_text()
        elif path.suffix == ".bytes":
            seen[path.stem] = "found" if credential.encode() in path.read_bytes() else "clean"
    return seen


def run_probe(runner, todo, out):
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "done", (todo.state, todo.last_error, runner.log_text())
    return json.loads((out / "whoami").read_text())


def test_an_agent_of_the_same_user_cannot_read_the_runners_credential(
        setup, runners, shared_dir, python_for_nobody):
    python, python_env = python_for_nobody
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    nobody = int(subprocess.check_output(["id", "-u", "nobody"], text=True))
    command, out = probe_command(python, shared_dir, shared_dir / "no-such-file")
    # The credential is in the runner's initial environment, which /proc keeps showing.
    runner = runners(url, credential, "--once", command=command, env=python_env,
                     program=["setpriv", *NOBODY, python, str(RUNNER)])
    whoami = run_probe(runner, todo, out)
    seen = findings(out, credential)
    assert whoami["uid"] == nobody
    # The runner ran as the same user (its status is readable; it names the uid).
    status = (out / "status.bytes").read_text()
    assert f"Uid:\t{nobody}\t{nobody}" in status, status
    # What a same-user process could otherwise read: non-dumpable closes each of them.
    for name in ("environ", "maps", "mem", "fd"):
        assert seen[name].startswith("denied: PermissionError"), seen
    assert seen["cmdline"] == "clean" and seen["status"] == "clean"
    # The agent holds its todo's own token, which the probe can read in its own /proc: the
    # same read works where the process allows it.
    assert whoami["env"]["SWITCHBOARD_TOKEN"].startswith("sbt_")
    assert seen["self_environ"] == "clean"
    assert whoami["env"]["SWITCHBOARD_TOKEN"].encode() in (out / "self_environ.bytes").read_bytes()
    assert credential not in json.dumps(whoami)
    assert "found" not in seen.values(), seen
    assert credential not in runner.log_text()


def test_the_separate_user_recipe_keeps_the_credential_file_out_of_the_agents_reach(
        setup, runners, shared_dir, python_for_nobody):
    """The runner as ``nobody`` reads ``--token-file``; the agent runs as a user of its own
    through setpriv (docs/runner.md#a-separate-user-for-the-agent)."""
    python, python_env = python_for_nobody
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    nobody = int(subprocess.check_output(["id", "-u", "nobody"], text=True))
    credential_file = credential_file_for(nobody, credential, shared_dir)
    probe, out = probe_command(python, shared_dir, credential_file)
    as_agent = ["setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups",
                "--inh-caps=-all", "--ambient-caps=-all", "--"]
    runner = runners(url, None, "--once", "--token-file", str(credential_file),
                     command=[*as_agent, *probe], env=python_env,
                     program=["setpriv", *NOBODY, "--inh-caps=+setuid,+setgid",
                              "--ambient-caps=+setuid,+setgid", python, str(RUNNER)])
    whoami = run_probe(runner, todo, out)
    seen = findings(out, credential)
    assert whoami["uid"] == AGENT_UID
    assert seen["credential_file"].startswith("denied: PermissionError"), seen
    for name in ("environ", "maps", "mem", "fd"):
        assert seen[name].startswith("denied: PermissionError"), seen
    # The todo reaches it on stdin (the runner's private directory is the runner user's).
    assert json.loads((out / "stdin.bytes").read_text())["id"] == str(todo.pk)
    assert whoami["env"]["SWITCHBOARD_TOKEN"].startswith("sbt_")
    assert "found" not in seen.values(), seen


def test_token_file_gives_the_runner_its_credential(setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    credential_file = tmp_path / "credential"
    credential_file.write_text(credential + "\n")
    credential_file.chmod(0o600)
    runner = runners(url, None, "--once", "--token-file", str(credential_file),
                     command=agent(tmp_path, "env", """
                         import os
                         print(os.environ["SWITCHBOARD_TOKEN"][:4])
                     """))
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "done", (todo.last_error, runner.log_text())
    assert todo.result["stdout_tail"].strip() == "sbt_"


@pytest.mark.parametrize("content", ["", "\n"])
def test_an_empty_token_file_is_refused(tmp_path, content):
    empty = tmp_path / "credential"
    empty.write_text(content)
    refused = subprocess.run(
        [sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x", "--token-file",
         str(empty), "--", "true"], capture_output=True, text=True, timeout=DEADLINE_SECONDS,
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "SWITCHBOARD_TOKEN"})
    assert refused.returncode == 2
    assert f"--token-file {empty}: empty or unreadable" in refused.stderr


def test_the_runner_warns_when_an_agent_cli_runs_without_require_settled(tmp_path):
    """The warning comes at start (here the server is unreachable, so --dry-run stops soon)."""
    claude = tmp_path / "claude"
    claude.write_text("#!/bin/sh\nexit 0\n")
    claude.chmod(0o755)
    run = subprocess.run(
        [sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x", "--dry-run", "--",
         str(claude), "-p", "{prompt}"], capture_output=True, text=True,
        timeout=DEADLINE_SECONDS, cwd=tmp_path, env={**os.environ, "SWITCHBOARD_TOKEN": "sbk_x"})
    assert ("Claude Code settles its own todo and exits 0 even when switchboard refused or "
            "could not reach it: give --require-settled") in run.stderr, run.stderr
    quiet = subprocess.run(
        [sys.executable, str(RUNNER), "--url", "http://127.0.0.1:9/mcp/x", "--dry-run",
         "--require-settled", "--", str(claude), "-p", "{prompt}"], capture_output=True,
        text=True, timeout=DEADLINE_SECONDS, cwd=tmp_path,
        env={**os.environ, "SWITCHBOARD_TOKEN": "sbk_x"})
    assert "--require-settled" not in quiet.stderr, quiet.stderr


# -- --repo-token-env, against the GitHub stand-in ----------------------------------------------

GRANT = {"contents": "write", "pull_requests": "write"}

# Prints what it was given, then waits (up to a deadline) for the token file to change when
# asked to, and prints what it then holds: ``env-token file-token mode [fresh-token]``.
REPO_TOKEN_AGENT = """
    import os, stat, sys, time
    path = os.environ.get("SWITCHBOARD_REPO_TOKEN_FILE")
    given = os.environ.get("GH_TOKEN", "-")
    if path is None:
        print(given, "-", "-")
        raise SystemExit(0)
    first = open(path).read().strip()
    mode = oct(stat.S_IMODE(os.stat(path).st_mode))
    fresh = "-"
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        now = open(path).read().strip()
        if now != first:
            fresh = now
            break
        time.sleep(0.2)
    print(given, first, mode, fresh)
"""


@pytest.fixture
def github_setup(start_daphne):
    """``setup`` on a server that may reach the GitHub stand-in over plain http on loopback."""
    server = start_daphne(DJANGO_SETTINGS_MODULE="tests.system.write_back_settings")
    owner = UserFactory(username="runner-github-owner")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="runner-github", owner=owner)
    return endpoint, credential, f"{server.url}/mcp/{endpoint.slug}"


def github_todo(setup, github, agent_permissions):
    """A GitHub App webhook routed to ``setup``'s endpoint, and one issue delivered to it."""
    from ingest import connections, transitions as ingest_transitions
    from ingest.tests.test_write_back import deliver, issue_opened

    endpoint, credential, url = setup
    operator = endpoint.owner
    connection, test = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=github.app_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    assert test.ok, test.error
    webhook, _ = ingest_transitions.create_webhook(slug="gh", owner=operator, source="github",
                                                   secret=SECRETS["github"])
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                         agent_permissions=agent_permissions)
    connections.set_webhook_connection(webhook, connection)
    return deliver("issues", issue_opened(), slug="gh")


def test_repo_token_env_gives_the_agent_a_repository_token_and_refreshes_its_file(
        github_setup, runners, tmp_path, github):
    # Just over the 5 minutes the server reuses a token for: the runner asks again within
    # seconds, gets a new one, and rewrites the file.
    github.token_lifetime = timedelta(minutes=5, seconds=3)
    setup = github_setup
    todo = github_todo(setup, github, GRANT)
    endpoint, credential, url = setup
    runner = runners(url, credential, "--once", "--repo-token-env", "GH_TOKEN",
                     command=[*agent(tmp_path, "gh", REPO_TOKEN_AGENT), "60"])
    assert runner.wait(timeout=120) == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "done", (todo.last_error, runner.log_text())
    seen = todo.result["stdout_tail"].split()
    assert len(seen) == 4, (seen, runner.log_text())
    given, first, mode, fresh = seen
    assert given == first and given.startswith("ghs_"), todo.result
    assert mode == "0o600"
    assert fresh.startswith("ghs_") and fresh != first, (todo.result, runner.log_text())
    minted = github.requests_to("apps/create-installation-access-token")
    assert len(minted) == 2
    assert all(request.body == {"repositories": [todo.payload["repository"]["name"]],
                                "permissions": GRANT} for request in minted)
    assert "repo_token_refreshed" in runner.log_text()
    assert first not in runner.log_text() and fresh not in runner.log_text()


def test_repo_token_env_without_a_grant_says_so_once_and_runs_the_agent_without(
        github_setup, runners, tmp_path, github):
    setup = github_setup
    todo = github_todo(setup, github, None)
    endpoint, credential, url = setup
    runner = runners(url, credential, "--once", "--repo-token-env", "GH_TOKEN",
                     command=[*agent(tmp_path, "gh", REPO_TOKEN_AGENT), "0"])
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "done", (todo.last_error, runner.log_text())
    assert todo.result["stdout_tail"].split() == ["-", "-", "-"]
    refused = [line for line in runner.log_text().splitlines() if "repo_token_refused" in line]
    assert len(refused) == 1 and "verb_not_allowed" in refused[0], runner.log_text()
    assert not github.requests_to("apps/create-installation-access-token")


def test_the_repository_token_is_due_5_minutes_before_it_expires():
    work = load_runner_module("work")
    now = datetime(2026, 1, 1, 12, 0, tzinfo=dt_timezone.utc)
    assert work.repo_token_wait_seconds("2026-01-01T13:00:00Z", now) == 55 * 60
    assert work.repo_token_wait_seconds("2026-01-01T12:04:00Z", now) == \
        work.REPO_TOKEN_MIN_WAIT_SECONDS
    assert work.repo_token_wait_seconds("not a time", now) == work.REPO_TOKEN_RETRY_SECONDS
