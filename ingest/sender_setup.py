"""How to point a real sender at a webhook: the steps per source the webhook page shows, and
whether the public URL is one a sender on the internet can reach at all.

Text only, no secrets: a step that needs the secret says where it came from (``add_webhook``
printed it, or the sender minted it and it was pasted with ``--secret``), never its value.
"""

import ipaddress
from urllib.parse import urlsplit

from . import senders

# Senders that mint the signing secret themselves: switchboard can only be told it.
SENDER_MINTED = frozenset(sender.source for sender in senders.SENDERS.values()
                          if sender.mints_own_secret)


def public_url_warning(public_url: str, source: str = "") -> str:
    """Why a sender on the internet cannot deliver to ``public_url`` ("" when it can). A sender
    with a local forwarder (Stripe's) gets it suggested; for the others a tunnel is the way."""
    parts = urlsplit(public_url)
    host = (parts.hostname or "").lower()
    loopback = host in ("localhost", "") or host.endswith(".localhost")
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            pass
    if loopback:
        command = senders.get_sender(source).local_forwarder if source else ""
        forwarder = (f", or use {source.capitalize()}'s local forwarder ({command})"
                     if command else "")
        return (f"The public URL {public_url} is a loopback address: senders on the internet "
                "cannot reach it. Set SWITCHBOARD_PUBLIC_URL to the https address a tunnel or "
                f"proxy gives this server (see docs/console.md){forwarder}.")
    if parts.scheme != "https":
        return (f"The public URL {public_url} is plain http: most senders refuse it or send "
                "payloads and signatures in the clear. Serve switchboard over https.")
    return ""


def setup_steps(source: str, hook_url: str, slug: str = "<slug>") -> list[str]:
    """The steps, in order, that connect ``source``'s real sender to ``hook_url`` (the webhook
    ``slug``'s). A secret the sender mints was pasted with ``add_webhook --secret`` already;
    the step says how to paste a new one when the sender's changes."""
    return senders.get_sender(source).setup_steps(hook_url, slug)
