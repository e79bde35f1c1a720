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


SIGNERS = {"github": github, "gitea": gitea, "gitlab": gitlab, "stripe": stripe,
           "standard": standard}
