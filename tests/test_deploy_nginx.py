"""deploy/nginx.conf: a valid site for Debian's nginx whose body cap is switchboard's.

The system suite (tests/system/test_proxy.py) runs its topology behind this file and probes
it; this checks, without starting anything, that it loads as Debian's nginx.conf includes a
site and that it still says what the README promises."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

SITE = Path(__file__).resolve().parent.parent / "deploy" / "nginx.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def directive(name: str, text: str) -> list[str]:
    return re.findall(rf"^\s*{name}\s+([^;]+);", text, flags=re.MULTILINE)


def location_block(path_pattern: str, text: str) -> str:
    match = re.search(rf"location {path_pattern} \{{(.*?)\n    \}}", text, flags=re.DOTALL)
    assert match, f"no location {path_pattern}"
    return match.group(1)


def test_the_body_cap_matches_switchboard_max_body_bytes():
    (cap,) = directive("client_max_body_size", SITE.read_text())
    units = {"k": 1024, "m": 1024 * 1024, "g": 1024 ** 3}
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", cap.lower()).groups()
    assert int(number) * units.get(unit, 1) == settings.SWITCHBOARD_MAX_BODY_BYTES


def test_timeouts_connection_limit_forwarding_and_unbuffered_streams():
    text = SITE.read_text()
    for name in ("client_header_timeout", "client_body_timeout", "limit_conn",
                 "limit_conn_zone"):
        assert directive(name, text), name
    assert "X-Forwarded-For $proxy_add_x_forwarded_for" in text
    assert "X-Forwarded-Proto $scheme" in text
    for stream in (r"/mcp/", r"~ \^/todos/\(\.\+/\)\?events\$"):
        block = location_block(stream, text)
        assert "proxy_buffering off" in block and "proxy_read_timeout 1h" in block, stream
    for path in ("/todos/events", "/todos/webhooks/gh/events"):
        assert re.match(r"^/todos/(.+/)?events$", path)


def test_sign_in_attempts_are_limited_per_address_at_the_proxy():
    """switchboard locks a (username, address) pair, never a username alone; the proxy bounds
    how many usernames one address may try."""
    text = SITE.read_text()
    (zone,) = directive("limit_req_zone", text)
    assert zone.startswith("$binary_remote_addr zone=switchboard_signin:")
    block = location_block(r"~ \^/\(accounts\|admin\)/login/\$", text)
    for path in ("/accounts/login/", "/admin/login/"):
        assert re.match(r"^/(accounts|admin)/login/$", path)
    assert "limit_req zone=switchboard_signin" in block and "limit_req_status 429" in block
    assert "proxy_pass http://switchboard_web" in block


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed: apt-get install nginx "
                                          "(scripts/test does it when run as root)")
def test_debian_nginx_accepts_the_site(tmp_path):
    # Debian's /etc/nginx/nginx.conf includes sites-enabled/* inside http { }; the same here,
    # with paths of our own so nothing of the machine's nginx is touched.
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp_path / name).mkdir()
    (tmp_path / "nginx.conf").write_text(f"""
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{ worker_connections 768; }}
http {{
    access_log {tmp_path}/access.log;
    client_body_temp_path {tmp_path}/client_body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    gzip on;
    include {SITE};
}}
""")
    checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_the_procfile_web_processes_listen_only_behind_the_proxy():
    """daphne binds loopback (or a unix socket): only the proxy reaches it. And it is not told
    to believe proxy headers itself: daphne's --proxy-headers takes the left-most
    X-Forwarded-For hop, which the client writes (switchboard/http/client_address.py instead)."""
    from tests.system.topology import procfile_web_argv

    argv = procfile_web_argv(8000)
    binds = [argv[i + 1] for i, arg in enumerate(argv) if arg in ("-b", "--bind")]
    sockets = [argv[i + 1] for i, arg in enumerate(argv) if arg in ("-u", "--unix-socket")]
    assert sockets or binds in (["127.0.0.1"], ["::1"]), argv
    assert "--proxy-headers" not in argv
