"""The Procfile topology, for real, for the system suite (issue 8).

``Topology`` starts, as subprocesses:

* a private PostgreSQL cluster (initdb + pg_ctl in a temporary directory, on a free port,
  fsync off) — private so the suite can restart it without touching the machine's shared
  server, where other test runs live;
* a private Redis (``redis-server --port <free> --save '' --appendonly no``) — restartable for
  the same reason;
* two ``daphne switchboard.asgi:application`` web processes on different free ports of
  127.0.0.1, one ``celery -A switchboard worker`` and one ``celery -A switchboard beat``
  (schedule file in the temporary directory), all with production settings on that PostgreSQL
  and Redis;
* the real nginx in front, configured by ``deploy/nginx.conf`` (the production shape, §12)
  rendered with the suite's ports: one listening port per web process, so a scenario can still
  address "web0" or "web1" (``web_urls``, through nginx); ``daphne_urls`` reach the web
  processes directly, for probes that compare the two.

Every process's stdout+stderr goes to a log file; ``all_logs()`` returns them all, so a test
can check that no bearer, secret or body was ever logged. Faults are methods: ``kill_web``,
``start_web``, ``kill_beat``, ``restart_redis``, ``restart_postgres``.
"""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent.parent


def find_pg_bindir() -> Path:
    """The newest installed PostgreSQL server binaries (Debian keeps them off PATH); the same
    search as scripts/test-services.sh."""
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                            key=lambda path: [int(part) for part in path.parent.name.split(".")
                                              if part.isdigit()], reverse=True):
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    raise RuntimeError("the system suite starts a private PostgreSQL: apt-get install postgresql")


PG_BIN = find_pg_bindir()
NGINX_SITE = ROOT / "deploy" / "nginx.conf"
# A deadline, not a wait (docs/testing.md, "Deterministic under load"): a loaded 2-core machine
# has taken most of a minute to start one Python process.
READY_DEADLINE_SECONDS = 120.0
# Production-like limits, except the rate limits: the scenarios deliberately push thousands of
# deliveries through one webhook and one credential within a minute.
RATE_PER_MINUTE = 10_000_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def poll(predicate, deadline_seconds: float, interval_seconds: float = 0.1):
    """Call ``predicate`` until it returns something truthy (returned) or the deadline passes
    (``None``)."""
    end = time.monotonic() + deadline_seconds
    while True:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - a service that is still starting may raise anything
            value = None
        if value:
            return value
        if time.monotonic() > end:
            return None
        time.sleep(interval_seconds)


def _pg_user() -> list[str]:
    """initdb refuses to run as root: run the cluster as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def procfile_web_argv(port: int) -> list[str]:
    """The Procfile's ``web:`` command as it runs with ``PORT=port`` (daphne from this
    interpreter), so the suite runs exactly the production bind."""
    line = next(line for line in (ROOT / "Procfile").read_text().splitlines()
                if line.startswith("web:"))
    argv = shlex.split(line.split(":", 1)[1].replace("${PORT:-8000}", str(port)))
    assert argv[0] == "daphne", argv
    return [sys.executable, "-m", "daphne", *argv[1:]]


def find_nginx() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if not found:
        raise RuntimeError("the system suite runs behind nginx: apt-get install nginx "
                           "(bash scripts/test installs it when run as root)")
    return found


def _replace_once(text: str, pattern: str, replacement: str, *, count: int = 1) -> str:
    """re.sub that insists on ``count`` matches, so a changed deploy/nginx.conf fails the
    rendering loudly instead of testing something else."""
    rendered, found = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if found != count:
        raise AssertionError(f"deploy/nginx.conf: expected {count} match(es) of {pattern!r}, "
                             f"found {found}")
    return rendered


def render_nginx_site(site: str, *, index: int, listen_port: int, upstream_port: int) -> str:
    """deploy/nginx.conf for web process ``index``: its own upstream (the one daphne) and
    listening port; the per-address zones are declared by the first copy only (the copies share
    them, as one server would)."""
    site = _replace_once(site, r"^upstream switchboard_web \{\n(?:\s+server [^\n]+;\n)+",
                         f"upstream switchboard_web {{\n    server 127.0.0.1:{upstream_port};\n")
    site = _replace_once(site, r"\bswitchboard_web\b", f"switchboard_web{index}", count=5)
    site = _replace_once(site, r"^    listen 80;$", f"    listen 127.0.0.1:{listen_port};")
    if index:
        site = _replace_once(site, r"^limit_conn_zone .*$", "")
        site = _replace_once(site, r"^limit_req_zone .*$", "")
    return site


class Process:
    """One named child process with its own log file."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self.popen = None

    def start(self):
        log = open(self.log_path, "ab")  # append: a restart keeps the earlier output
        self.popen = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Signal the whole process group (Celery's pool children too) and reap the leader."""
        if not self.alive:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Topology:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="sb-system-"))
        os.chmod(self.dir, 0o755)
        self.log_dir = self.dir / "logs"
        self.log_dir.mkdir()
        os.chmod(self.log_dir, 0o777)  # the private PostgreSQL (user postgres) logs here too
        self.pg_port, self.redis_port = free_port(), free_port()
        self.pg_data = self.dir / "pgdata"
        self.pg_socket_dir = self.dir / "pgsock"
        self.database_url = f"postgres://postgres@127.0.0.1:{self.pg_port}/switchboard"
        self.admin_url = f"postgres://postgres@127.0.0.1:{self.pg_port}/postgres"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.env = {
            **{k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "REDIS_URL", "CHANNEL_PREFIX")},
            "DJANGO_SETTINGS_MODULE": "switchboard.settings",
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "CHANNEL_PREFIX": "sbsys",
            "SECRET_KEY": "system-suite-secret-key-not-for-production",
            "SWITCHBOARD_VAR_DIR": str(self.dir / "var"),
            "SWITCHBOARD_PUBLIC_URL": "http://127.0.0.1:8000",
            # Production refuses to start without a secrets key of its own (a test key).
            "SWITCHBOARD_SECRETS_KEY": "c3lzdGVtLXN1aXRlLW9ubHktc2VjcmV0cy1rZXkhISE=",
            # nginx (deploy/nginx.conf) is the peer of every request: believe its
            # X-Forwarded-For, as production does.
            "SWITCHBOARD_TRUSTED_PROXIES": "127.0.0.1",
            "SWITCHBOARD_INGEST_RATE_PER_MINUTE": str(RATE_PER_MINUTE),
            "SWITCHBOARD_MCP_RATE_PER_MINUTE": str(RATE_PER_MINUTE),
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "INFO",
        }
        self.webs: list[Process] = []
        self.web_urls: list[str] = []  # through nginx
        self.daphne_urls: list[str] = []  # the web processes themselves
        self.worker = self.beat = self.redis = self.nginx = None

    # -- PostgreSQL (private cluster) ------------------------------------------------------

    def _pg(self, *args, check=True):
        return subprocess.run([*_pg_user(), *args], check=check, capture_output=True, text=True)

    def init_postgres(self):
        for path in (self.pg_data, self.pg_socket_dir):
            path.mkdir()
            if os.geteuid() == 0:
                shutil.chown(path, "postgres", "postgres")
        self._pg(str(PG_BIN / "initdb"), "-D", str(self.pg_data), "-U", "postgres", "-A", "trust",
                 "--no-sync", "-E", "UTF8")
        self.start_postgres()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE switchboard")

    def start_postgres(self):
        options = (f"-p {self.pg_port} -k {self.pg_socket_dir} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=300")
        done = self._pg(str(PG_BIN / "pg_ctl"), "-D", str(self.pg_data), "-o", options,
                        "-l", str(self.log_dir / "postgresql.log"), "-w", "-t", "60", "start",
                        check=False)
        if done.returncode:
            raise RuntimeError(f"pg_ctl start failed: {done.stdout}{done.stderr}")

    def stop_postgres(self, mode="fast"):
        self._pg(str(PG_BIN / "pg_ctl"), "-D", str(self.pg_data), "-m", mode, "-w", "stop",
                 check=False)

    def restart_postgres(self):
        """Stop (fast: every connection is cut) and start the cluster again."""
        self.stop_postgres("fast")
        self.start_postgres()

    def connect(self, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.database_url, autocommit=True, **kwargs)

    # -- Redis (private) -------------------------------------------------------------------

    def start_redis(self):
        self.redis = Process("redis", ["redis-server", "--port", str(self.redis_port),
                                       "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                       "--daemonize", "no"], self.env, self.log_dir).start()
        import redis

        client = redis.Redis(port=self.redis_port)
        assert poll(client.ping, READY_DEADLINE_SECONDS), "private redis did not start"
        client.close()

    def restart_redis(self):
        self.redis.kill()
        self.start_redis()

    # -- the Procfile processes ------------------------------------------------------------

    def manage(self, *args) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"manage.py {args[0]} failed:\n{done.stderr}")
        return done.stdout

    def start_web(self, index: int):
        port = int(self.daphne_urls[index].rsplit(":", 1)[1])
        process = Process(f"web{index}", procfile_web_argv(port), self.env, self.log_dir).start()
        self.webs[index] = process
        self.wait_web_ready(index)
        return process

    def wait_web_ready(self, index: int):
        process = self.webs[index]
        # Through nginx once it runs (both hops answer), else the process directly.
        url = self.web_urls[index] if self.nginx is not None else self.daphne_urls[index]

        def ready():
            if not process.alive:
                raise AssertionError(f"web{index} exited:\n{process.log_text()[-3000:]}")
            return httpx.get(url + "/readyz", timeout=10.0).status_code == 200

        try:
            ok = poll(ready, READY_DEADLINE_SECONDS)
        except AssertionError:
            raise
        assert ok or process.alive, f"web{index} exited:\n{process.log_text()[-3000:]}"
        assert ok, f"web{index} not ready:\n{process.log_text()[-3000:]}"

    def kill_web(self, index: int):
        self.webs[index].kill(signal.SIGKILL)

    def start_worker(self):
        self.worker = Process("worker", [sys.executable, "-m", "celery", "-A", "switchboard",
                                         "worker", "--loglevel", "INFO", "--concurrency", "2",
                                         "--without-gossip", "--without-mingle"],
                              self.env, self.log_dir).start()

    def start_beat(self):
        self.beat = Process("beat", [sys.executable, "-m", "celery", "-A", "switchboard", "beat",
                                     "--loglevel", "INFO", "--schedule",
                                     str(self.dir / "celerybeat-schedule")],
                            self.env, self.log_dir).start()

    def kill_beat(self):
        self.beat.kill(signal.SIGKILL)

    # -- nginx in front (deploy/nginx.conf) -------------------------------------------------

    def start_nginx(self):
        prefix = self.dir / "nginx"
        prefix.mkdir()
        temp = {}
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            temp[name] = prefix / f"{name}_temp"
            temp[name].mkdir()
            os.chmod(temp[name], 0o777)  # started as root, nginx's workers run as nobody
        site = NGINX_SITE.read_text()
        sites = [render_nginx_site(site, index=index,
                                   listen_port=int(self.web_urls[index].rsplit(":", 1)[1]),
                                   upstream_port=int(self.daphne_urls[index].rsplit(":", 1)[1]))
                 for index in range(len(self.web_urls))]
        (prefix / "site.conf").write_text("\n".join(sites))
        # What Debian's /etc/nginx/nginx.conf gives the site, with this run's paths.
        (prefix / "nginx.conf").write_text(f"""
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {self.log_dir}/nginx-error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log {self.log_dir}/nginx-access.log;
    client_body_temp_path {temp["client_body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    gzip on;
    include {prefix}/site.conf;
}}
""")
        self.nginx = Process("nginx", [find_nginx(), "-p", str(prefix), "-c",
                                       str(prefix / "nginx.conf"), "-g", "daemon off;"],
                             self.env, self.log_dir).start()
        for index, url in enumerate(self.web_urls):
            assert poll(lambda: httpx.get(url + "/readyz", timeout=10.0).status_code == 200,
                        READY_DEADLINE_SECONDS), (
                f"nginx -> web{index} not ready:\n{self.nginx.log_text()[-3000:]}"
                f"{(self.log_dir / 'nginx-error.log').read_text(errors='replace')[-3000:]}")

    def start(self):
        self.init_postgres()
        self.start_redis()
        self.manage("migrate", "-v0")
        self.daphne_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.web_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.webs = [None, None]
        for index in range(2):
            self.start_web(index)
        self.start_nginx()
        self.start_worker()
        self.start_beat()
        return self

    def stop(self):
        for process in [self.nginx, *self.webs, self.worker, self.beat, self.redis]:
            if process is not None:
                process.kill(signal.SIGTERM)
        self.stop_postgres("immediate")

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def all_logs(self) -> dict[str, str]:
        return {path.name: path.read_text(errors="replace")
                for path in sorted(self.log_dir.glob("*.log"))}
