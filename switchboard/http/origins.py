"""Web origins, compared exactly: ``(scheme, host, port)`` (RFC 6454), for the MCP endpoint's
Origin check (docs/security.md) and the settings that configure it.

Strict on purpose. An Origin header is ``scheme://host[:port]`` and nothing else; anything with
user info, a backslash, a path, a query or a fragment is refused rather than interpreted,
because parsers disagree on it: ``http://evil\\@127.0.0.1`` is host ``127.0.0.1`` to Python's
``urlsplit`` but host ``evil`` to a browser.
"""

import re

DEFAULT_PORTS = {"http": 80, "https": 443}
# host: a DNS name / IPv4 address, or a bracketed IPv6 literal; port: 1-5 digits.
_ORIGIN_RE = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://"
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~]+)(?::(?P<port>[0-9]{1,5}))?$")


def parse_origin(text: str, *, allow_path: bool = False):
    """``(scheme, host, port)`` with scheme and host lower-cased and the scheme's default port
    filled in, or None for anything that is not an http(s) origin. ``allow_path`` accepts a
    URL with a path (a configured public URL such as ``https://example.org/sb``) and keeps
    only its origin."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    if allow_path:
        match = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)(?:[/?#].*)?$", text)
        text = match.group(1) if match else text
    match = _ORIGIN_RE.match(text)
    if match is None:
        return None
    scheme = match["scheme"].lower()
    if scheme not in DEFAULT_PORTS:
        return None
    port = int(match["port"]) if match["port"] else DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        return None
    return scheme, match["host"].lower().rstrip("."), port
