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
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.processes import DEADLINE_SECONDS
from test_runner import (RUNNER, TOKEN_ENV, agent, make_todos, runners,  # noqa: F401
                         setup)
from todos.models import Todo

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
