"""Build deliveries the way each source signs them (test helper)."""

import base64
import hashlib
import hmac
import json
import time
import uuid


def body_of(payload) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def github(secret: str, body: bytes, *, event="issues", delivery=None) -> dict:
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "HTTP_X_HUB_SIGNATURE_256": f"sha256={signature}",
        "HTTP_X_GITHUB_EVENT": event,
        "HTTP_X_GITHUB_DELIVERY": delivery or str(uuid.uuid4()),
    }


def gitea(secret: str, body: bytes, *, event="issues", delivery=None, forgejo=False) -> dict:
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    name = "FORGEJO" if forgejo else "GITEA"
    return {
        f"HTTP_X_{name}_SIGNATURE": signature,
        f"HTTP_X_{name}_EVENT": event,
        f"HTTP_X_{name}_DELIVERY": delivery or str(uuid.uuid4()),
    }


def gitlab(secret: str, body: bytes, *, event="Merge Request Hook", delivery=None) -> dict:
    return {
        "HTTP_X_GITLAB_TOKEN": secret,
        "HTTP_X_GITLAB_EVENT": event,
        "HTTP_X_GITLAB_EVENT_UUID": delivery or str(uuid.uuid4()),
    }


def stripe(secret: str, body: bytes, *, timestamp=None) -> dict:
    stamp = int(time.time()) if timestamp is None else timestamp
    signature = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return {"HTTP_STRIPE_SIGNATURE": f"t={stamp},v1={signature}"}


def standard(secret: str, body: bytes, *, timestamp=None, message_id=None) -> dict:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    message_id = message_id or f"msg_{uuid.uuid4().hex}"
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{message_id}.{stamp}.".encode() + body
    signature = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return {
        "HTTP_WEBHOOK_ID": message_id,
        "HTTP_WEBHOOK_TIMESTAMP": stamp,
        "HTTP_WEBHOOK_SIGNATURE": f"v1,{signature}",
    }


def linear_body(payload: dict, *, at_ms=None) -> bytes:
    """Linear's body carries its own signed timestamp (milliseconds): now, unless given."""
    stamp = int(time.time() * 1000) if at_ms is None else at_ms
    return json.dumps({**payload, "webhookTimestamp": stamp}).encode()


def linear(secret: str, body: bytes, *, delivery=None, event=None) -> dict:
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    meta = {"HTTP_LINEAR_SIGNATURE": signature,
            "HTTP_LINEAR_DELIVERY": delivery or str(uuid.uuid4())}
    if event:
        meta["HTTP_LINEAR_EVENT"] = event
    return meta


def slack(secret: str, body: bytes, *, timestamp=None, retry=None, retry_reason=None) -> dict:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    signed = f"v0:{stamp}:".encode() + body
    meta = {"HTTP_X_SLACK_SIGNATURE": "v0=" + hmac.new(secret.encode(), signed,
                                                       hashlib.sha256).hexdigest(),
            "HTTP_X_SLACK_REQUEST_TIMESTAMP": stamp}
    if retry is not None:
        meta["HTTP_X_SLACK_RETRY_NUM"] = str(retry)
        meta["HTTP_X_SLACK_RETRY_REASON"] = retry_reason or "http_timeout"
    return meta


def sentry(secret: str, body: bytes, *, resource="issue", delivery=None) -> dict:
    return {
        "HTTP_SENTRY_HOOK_SIGNATURE": hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
        "HTTP_SENTRY_HOOK_RESOURCE": resource,
        "HTTP_SENTRY_HOOK_TIMESTAMP": str(int(time.time())),
        "HTTP_REQUEST_ID": delivery or str(uuid.uuid4()),
    }


SIGNERS = {"github": github, "gitea": gitea, "gitlab": gitlab, "stripe": stripe,
           "standard": standard, "linear": linear, "slack": slack, "sentry": sentry}
