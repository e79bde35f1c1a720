"""Unsigned: no proof of origin, for senders that cannot sign. Anyone who knows the URL may
post, so its todos are ``unverified`` and never rung (docs/reference.md#trust), its bodies
are capped lower (SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES) and it has no secret."""

from . import Sender, standard
from ..models import Source, TrustMode
from ..verification import Envelope


def verify(webhook, headers, body, now) -> Envelope:
    return Envelope(TrustMode.UNVERIFIED, "", "")


def check_secret(secret: str) -> None:
    if secret:
        raise ValueError("unsigned webhooks take no secret")


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        f"Send POST requests with a JSON body to {hook_url}.",
        "Nothing is verified: anyone who knows the URL can create work (trust unverified).",
    ]


SENDER = Sender(
    source=Source.UNSIGNED, verify=verify, derive_kind=standard.derive_kind,
    derive_title=standard.derive_title, setup_steps=setup_steps, signed=False,
    mint_secret=lambda: "", check_secret=check_secret)
