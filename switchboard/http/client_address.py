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
"""

import functools
import ipaddress

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# The peer of a connection over a unix socket has no address (ASGI ``client`` is None).
UNIX_SOCKET_PEER = "unix"


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


def scope_with_client_address(scope: dict) -> dict:
    """``scope`` with ``client`` set to the client behind a trusted proxy (a new dict); the
    same scope when no proxy is trusted or the peer is not one."""
    if not settings.SWITCHBOARD_TRUSTED_PROXIES:
        return scope
    peer = scope.get("client")
    forwarded = ",".join(value.decode("latin-1") for name, value in scope.get("headers", ())
                         if name.lower() == b"x-forwarded-for")
    client = find_client_address(peer[0] if peer else None, forwarded)
    if peer and client == peer[0]:
        return scope
    # The proxy's port says nothing about the client's: 0, as for an unknown port.
    return {**scope, "client": None if client == UNIX_SOCKET_PEER else (client, 0)}
