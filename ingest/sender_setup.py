"""How to point a real sender at a webhook: the steps per source the webhook page shows, and
whether the public URL is one a sender on the internet can reach at all.

Text only, no secrets: a step that needs the secret says where it came from (``add_webhook``
printed it, or the sender minted it and it was pasted with ``--secret``), never its value.
"""

import ipaddress
from urllib.parse import urlsplit

from .models import Source

# Senders that mint the signing secret themselves: switchboard can only be told it.
SENDER_MINTED = frozenset({Source.STRIPE, Source.LINEAR, Source.SLACK, Source.SENTRY})


def public_url_warning(public_url: str, source: str = "") -> str:
    """Why a sender on the internet cannot deliver to ``public_url`` ("" when it can). Only
    Stripe has a local forwarder to suggest; for the others a tunnel is the way."""
    parts = urlsplit(public_url)
    host = (parts.hostname or "").lower()
    loopback = host in ("localhost", "") or host.endswith(".localhost")
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            pass
    if loopback:
        forwarder = (", or use Stripe's local forwarder (stripe listen --forward-to)"
                     if source == Source.STRIPE else "")
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
    if source == Source.GITHUB:
        return [
            "Repository (or organisation) → Settings → Webhooks → Add webhook.",
            f"Payload URL: {hook_url}",
            "Content type: application/json",
            "Secret: the secret add_webhook printed (rotate_webhook_secret mints a new one).",
            "Which events: “Let me select individual events” and tick the ones this "
            "webhook's routes take (Issues, Pull requests, Workflow runs, …).",
            "After saving, the webhook's “Recent deliveries” tab shows each request and "
            "answer; “Redeliver” there re-sends one.",
        ]
    if source == Source.GITEA:
        return [
            "Repository → Settings → Webhooks → Add webhook → Gitea (Forgejo: Forgejo).",
            f"Target URL: {hook_url}",
            "HTTP method POST, POST content type application/json.",
            "Secret: the secret add_webhook printed.",
            "Trigger on the events this webhook's routes take; the webhook's page lists "
            "recent deliveries with a “Test delivery” button.",
        ]
    if source == Source.GITLAB:
        return [
            "Project (or group) → Settings → Webhooks → Add new webhook.",
            f"URL: {hook_url}",
            "Secret token: the secret add_webhook printed (GitLab sends it as "
            "X-Gitlab-Token).",
            "Trigger: the events this webhook's routes take (Issues, Merge requests, "
            "Pipelines, …); “Edit” → “Recent events” shows each request.",
        ]
    if source == Source.STRIPE:
        return [
            "Stripe mints the signing secret: Developers → Webhooks → Add endpoint, "
            f"endpoint URL {hook_url}, select the events.",
            "Its signing secret (whsec_…) is the one add_webhook … --secret took; when Stripe "
            f"rolls it, paste the new one: manage.py rotate_webhook_secret {slug} "
            "--secret 'whsec_…'.",
            f"Locally, without a public URL: stripe listen --forward-to {hook_url} "
            "prints a whsec_… secret of its own; paste that one the same way.",
            "Stripe's endpoint page lists every attempt and its answer.",
        ]
    if source == Source.STANDARD:
        return [
            f"Give the sender the URL {hook_url} and the whsec_… secret add_webhook printed.",
            "The sender signs as Standard Webhooks says: webhook-id, webhook-timestamp "
            "(within 300 s) and webhook-signature: v1,<base64 HMAC-SHA256>.",
        ]
    if source == Source.LINEAR:
        return [
            "Linear mints the secret: Settings → API → Webhooks → New webhook, "
            f"URL {hook_url}, pick the resource types.",
            "Its signing secret (lin_wh_…) is the one add_webhook … --secret took; when "
            f"Linear's changes, paste the new one: manage.py rotate_webhook_secret {slug} "
            "--secret 'lin_wh_…'.",
        ]
    if source == Source.SLACK:
        return [
            "api.slack.com/apps → your app → Basic Information → App Credentials → "
            "Signing Secret: the one add_webhook … --secret took; when Slack regenerates it, "
            f"paste the new one: manage.py rotate_webhook_secret {slug} --secret ….",
            f"Event Subscriptions → Enable → Request URL: {hook_url} (switchboard answers "
            "Slack's url_verification, and Slack shows “Verified”).",
            "Subscribe to the bot events you route and reinstall the app.",
        ]
    if source == Source.SENTRY:
        return [
            "Settings → Developer Settings → Custom Integrations → New Internal Integration; "
            f"Webhook URL {hook_url}; subscribe to issue (and error, comment as needed).",
            "Its Client Secret is the one add_webhook … --secret took; when Sentry's "
            f"changes, paste the new one: manage.py rotate_webhook_secret {slug} --secret ….",
            "Sentry does not retry: check this page's deliveries after setup.",
        ]
    return [
        f"Send POST requests with a JSON body to {hook_url}.",
        "Nothing is verified: anyone who knows the URL can create work (trust unverified).",
    ]
