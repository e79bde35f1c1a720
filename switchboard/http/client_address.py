"""The client's network address, proxy-aware (limits and checks per address;
docs/operating.md#the-reverse-proxy-required).

In the production shape (deploy/nginx.conf) every request reaches daphne from the reverse
proxy, so the peer address is the proxy's, for everyone. ``SWITCHBOARD_TRUSTED_PROXIES`` names
the proxies (addresses or networks, or ``unix`` for daphne on a unix socket): when the peer is
one of them, the client is the right-most ``X-Forwarded-For`` entry that is not itself a
trusted proxy. Entries further left were written by whoever sent the request and prove nothing
(a client can send its own ``X-Forwarded-For``; the proxy appends to it). Unset (the default),
nobody is trusted and the peer is the client — the header is ignored, so a client talking to
daphne directly cannot pick its own address.

The one ASGI entry point (switchboard/asgi.py) puts the client's address into the scope's
``client`` before routing, so every consumer, plain ASGI app and Django view (``REMOTE_ADDR``)
sees the client, never the proxy, without asking again. Do not run daphne with
``--proxy-headers`` instead: it believes the left-most ``X-Forwarded-For`` entry, which is the
one a client can write.

No address is trusted for being loopback. A tunnel on the same machine (docs/senders.md's way
to expose the embedded default) is a proxy like any other: unnamed, it makes every client
127.0.0.1, so a loopback peer sending ``X-Forwarded-For`` while no proxy is trusted is logged,
once per process.
"""

import functools
import ipaddress
import logging

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger(__name__)

# The peer of a connection over a unix socket has no address (ASGI ``client`` is None).
UNIX_SOCKET_PEER = "unix"
_untrusted_forwarding_logged = False


@functools.lru_cache(maxsize=8)
def parse_trusted_proxies(entries: tuple[str, ...]) -> tuple:
    """``("127.0.0.1", "10.0.0.0/8", "unix")`` -> networks (and the unix marker); a bad entry
    raises ImproperlyConfigured naming the setting."""
    parsed = []
    for entry in entries:
        if entry == UNIX_SOCKET_PEER:
            parsed.append(entry)
            continue
        try:
            parsed.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"SWITCHBOARD_TRUSTED_PROXIES: {entry!r} is not an address, a network or "
                f"{UNIX_SOCKET_PEER!r}") from None
    return tuple(parsed)


def _is_trusted(address: str, trusted: tuple) -> bool:
    if address == UNIX_SOCKET_PEER:
        return UNIX_SOCKET_PEER in trusted
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(not isinstance(net, str) and ip in net for net in trusted)


def find_client_address(peer: str | None, forwarded_for: str) -> str:
    """The client behind ``peer`` (the connection's address, None over a unix socket), given
    the request's ``X-Forwarded-For`` text (all such headers joined by commas)."""
    peer = peer or UNIX_SOCKET_PEER
    trusted = parse_trusted_proxies(tuple(settings.SWITCHBOARD_TRUSTED_PROXIES))
    if not trusted or not _is_trusted(peer, trusted):
        return peer
    hops = [hop.strip() for hop in forwarded_for.split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _is_trusted(hop, trusted):
            return hop
    # Only proxies (or no header): the request started at a proxy's own host.
    return hops[0] if hops else peer


def request_client_address(request) -> str | None:
    """The sign-in lockout's address (django-axes' AXES_CLIENT_IP_CALLABLE): the one the ASGI
    entry point settled on, never a header axes would read itself were django-ipware present."""
    return request.META.get("REMOTE_ADDR")


def _note_untrusted_forwarding(scope: dict) -> None:
    global _untrusted_forwarding_logged
    peer = scope.get("client")
    try:
        loopback = bool(peer) and ipaddress.ip_address(peer[0]).is_loopback
    except ValueError:
        return
    if loopback and any(name.lower() == b"x-forwarded-for"
                        for name, _ in scope.get("headers", ())):
        _untrusted_forwarding_logged = True
        log.warning(
            "requests from %s carry X-Forwarded-For but SWITCHBOARD_TRUSTED_PROXIES is unset: "
            "every client of the proxy or tunnel in front shares its address (per-address "
            "limits, sign-in lockouts); name it (docs/configuration.md)", peer[0])


def scope_with_client_address(scope: dict) -> dict:
    """``scope`` with ``client`` set to the client behind a trusted proxy (a new dict); the
    same scope when no proxy is trusted or the peer is not one."""
    if not settings.SWITCHBOARD_TRUSTED_PROXIES:
        if not _untrusted_forwarding_logged:
            _note_untrusted_forwarding(scope)
        return scope
    peer = scope.get("client")
    forwarded = ",".join(value.decode("latin-1") for name, value in scope.get("headers", ())
                         if name.lower() == b"x-forwarded-for")
    client = find_client_address(peer[0] if peer else None, forwarded)
    if peer and client == peer[0]:
        return scope
    # The proxy's port says nothing about the client's: 0, as for an unknown port.
    return {**scope, "client": None if client == UNIX_SOCKET_PEER else (client, 0)}
