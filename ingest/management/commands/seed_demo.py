"""``manage.py seed_demo``: everything needed to watch one todo go round (CONTRACT §2, §11).

Creates (or reuses) an operator, an endpoint with a fresh credential, a GitHub-style webhook
and a route between them, then prints a ready-to-paste ``.mcp.json`` and a ``curl`` that
delivers a signed sample event. GitHub's scheme signs the body only, so the printed signature
stays valid however late the curl is pasted; the delivery id is minted by the shell on each
paste, so every paste is a new delivery rather than an idempotent repeat. Safe to run again:
existing rows are reused and the endpoint gets a new credential (the old one keeps its grace).
"""

import hashlib
import hmac
import json
import shlex

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import transaction

from endpoints import transitions as endpoint_transitions
from endpoints.models import Endpoint
from ingest import transitions
from ingest.models import Route, Source, Webhook
from switchboard.commands import JsonCommand

DEMO_QUEUE = "inbox"
SAMPLE_EVENT = {
    "action": "opened",
    "issue": {"number": 1, "title": "Try switchboard: claim me, then complete me",
              "html_url": "https://example.invalid/demo/switchboard/issues/1"},
    "repository": {"full_name": "demo/switchboard"},
    "sender": {"login": "demo"},
}


def sign_github(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def build_curl(hook_url: str, secret: str) -> str:
    body = json.dumps(SAMPLE_EVENT, separators=(",", ":"))
    return " ".join([
        "curl -sS -X POST", shlex.quote(hook_url),
        "-H 'Content-Type: application/json'",
        "-H 'X-GitHub-Event: issues'",
        # Minted by the shell at paste time: each paste is a new delivery.
        '-H "X-GitHub-Delivery: demo-$(date +%s%N)"',
        "-H " + shlex.quote(f"X-Hub-Signature-256: {sign_github(secret, body.encode())}"),
        "--data-binary", shlex.quote(body),
    ])


class Command(JsonCommand):
    help = ("Create a demo operator, endpoint (+ credential), GitHub-style webhook and route; "
            "print a ready-to-paste .mcp.json and a curl that delivers a signed sample event.")

    def add_arguments(self, parser):
        parser.add_argument("--operator", default="demo", help="operator username (default demo)")
        parser.add_argument("--password", help="set this password for the operator (board login)")
        parser.add_argument("--endpoint", default="demo-agent", help="endpoint slug")
        parser.add_argument("--webhook", default="demo-hook", help="webhook slug")

    def handle(self, *args, operator, password, endpoint, webhook, **options):
        with transaction.atomic():
            user = self.find_or_create_operator(operator, password)
            agent_endpoint, credential = self.find_or_vend_endpoint(endpoint, user)
            hook = self.find_or_create_webhook(webhook, user)
            Route.objects.get_or_create(webhook=hook, endpoint=agent_endpoint, queue=DEMO_QUEUE)
        base = settings.SWITCHBOARD_PUBLIC_URL
        mcp_url = f"{base}/mcp/{agent_endpoint.slug}"
        hook_url = f"{base}/hooks/{hook.slug}"
        mcp_json = {"mcpServers": {"switchboard": {
            "type": "http", "url": mcp_url, "headers": {"Authorization": f"Bearer {credential}"},
        }}}
        curl = build_curl(hook_url, hook.secret)
        data = {
            "operator": user.get_username(), "endpoint": agent_endpoint.slug, "mcp_url": mcp_url,
            "credential": credential, "webhook": hook.slug, "hook_url": hook_url,
            "secret": hook.secret, "mcp_json": mcp_json, "curl": curl,
        }
        self.emit(options, data, "\n".join([
            f"operator {user.get_username()}"
            + ("" if password else f" (set a password: manage.py changepassword {user.get_username()})"),
            f"endpoint {agent_endpoint.slug}: {mcp_url}",
            f"webhook {hook.slug} (github): {hook_url}",
            "", ".mcp.json (the credential is shown only now):", json.dumps(mcp_json, indent=2),
            "", "deliver a signed sample event:", curl,
            "", f"then watch it on {base}/todos/",
        ]))

    def find_or_create_operator(self, username, password):
        User = get_user_model()
        user, created = User.objects.get_or_create(username=username)
        if created or password:
            if password:
                user.set_password(password)
            else:
                user.set_unusable_password()
            user.save()
        return user

    def find_or_vend_endpoint(self, slug, owner):
        existing = Endpoint.objects.filter(slug=slug).first()
        if existing is None:
            return endpoint_transitions.vend_endpoint(slug=slug, owner=owner)
        if existing.owner_id != owner.pk:
            raise CommandError(f"endpoint {slug!r} exists and belongs to someone else")
        return existing, endpoint_transitions.rotate_credential(existing)

    def find_or_create_webhook(self, slug, owner):
        existing = Webhook.objects.filter(slug=slug).first()
        if existing is None:
            hook, _ = transitions.create_webhook(slug=slug, owner=owner, source=Source.GITHUB)
            return hook
        if existing.owner_id != owner.pk or existing.source != Source.GITHUB:
            raise CommandError(f"webhook {slug!r} exists and is not this operator's github webhook")
        return existing
