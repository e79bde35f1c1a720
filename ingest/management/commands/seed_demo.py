"""``manage.py seed_demo``: everything needed to watch one todo go round
(docs/commands.md#seed_demo).

Creates (or reuses) an operator, an endpoint with a fresh credential, a GitHub-style webhook
and a route between them, then prints a ready-to-paste ``.mcp.json`` (it names
``$SWITCHBOARD_TOKEN``, never the credential, so it can be committed) and a ``curl`` that
delivers a signed sample event. The shell mints a nonce in the body, signs it (openssl) and
mints the delivery id on each paste, so every paste is a new delivery rather than an
idempotent repeat or a refused replay. Safe to run again:
existing rows are reused, and so is the demo credential, so what an earlier run printed keeps
working. ``--rotate`` mints a new one and revokes the earlier ones at once (zero grace).

Credentials are stored as digests only, so the demo credential is one seed_demo can derive
again: an HMAC of its credential row's id under SECRET_KEY (``demo_credential_for``). A re-run
reprints it while that row is live; rows are never reused, so a revoked one never comes back.

The operator is staff (not superuser) with the permissions the admin needs for its own rows
(endpoints, webhooks, todos: every admin page scopes them to the owner), and can sign in: with
no --password, a password is generated when the account has no usable one and printed once
(to stderr under --json, whose keys are exactly the documented ones).
"""

import base64
import hmac
import json
import secrets
import shlex
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management.base import CommandError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.crypto import salted_hmac

from endpoints import connect_snippets
from endpoints import transitions as endpoint_transitions
from endpoints.models import CREDENTIAL_PREFIX, Endpoint, hash_credential
from ingest import transitions
from ingest.models import Route, Source, Webhook
from switchboard.commands import JsonCommand

DEMO_QUEUE = "inbox"
# The admin pages the demo operator may use; each scopes its rows to the signed-in owner.
DEMO_ADMIN_APPS = ("endpoints", "ingest", "todos")
SAMPLE_EVENT = {
    "action": "opened",
    "issue": {"number": 1, "title": "Try switchboard: claim me, then complete me",
              "html_url": "https://example.invalid/demo/switchboard/issues/1"},
    "repository": {"full_name": "demo/switchboard"},
    "sender": {"login": "demo"},
}


# Stands in the sample body for the shell's per-paste nonce (see build_curl).
NONCE_PLACEHOLDER = "@@NONCE@@"


def build_curl(hook_url: str, secret: str) -> str:
    """A curl that delivers the sample event, signed by the shell at paste time (openssl): the
    body carries a per-paste nonce, so each paste is a new signed body, not a replay of the
    last one under a new delivery id (which switchboard refuses as a replay)."""
    body = json.dumps({**SAMPLE_EVENT, "demo_paste": NONCE_PLACEHOLDER}, separators=(",", ":"))
    head, _, tail = body.partition(NONCE_PLACEHOLDER)
    return "".join([
        "B=", shlex.quote(head), '"$(date +%s%N)"', shlex.quote(tail), "; ",
        " ".join([
            "curl -sS -X POST", shlex.quote(hook_url),
            "-H 'Content-Type: application/json'",
            "-H 'X-GitHub-Event: issues'",
            '-H "X-GitHub-Delivery: demo-$(date +%s%N)"',
            '-H "X-Hub-Signature-256: sha256=$(printf %s "$B" | openssl dgst -sha256 -hmac '
            + shlex.quote(secret) + " | sed 's/^.*= //')\"",
            '--data-binary "$B"',
        ]),
    ])


def demo_credential_for(credential_row) -> str:
    """The demo credential a credential row stands for (derived, so never stored in plain)."""
    digest = salted_hmac("switchboard.seed_demo.credential", str(credential_row.pk),
                         algorithm="sha256").digest()
    return CREDENTIAL_PREFIX + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def ensure_demo_credential(endpoint, *, rotate: bool) -> str:
    """The endpoint's live demo credential, reused; a new one (every other credential revoked
    at once) with ``rotate`` or when none is live (first run, or rotated away by hand)."""
    if not rotate:
        for row in endpoint.credentials.filter(
                Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())).order_by("-pk"):
            credential = demo_credential_for(row)
            if hmac.compare_digest(row.digest, hash_credential(credential)):
                return credential
    # Zero grace: credentials printed by earlier runs stop working now.
    endpoint_transitions.rotate_credential(endpoint, grace=timedelta(0))
    row = endpoint.credentials.order_by("-pk").first()
    credential = demo_credential_for(row)
    endpoint_transitions.rekey_credential(row.pk, credential)
    return credential


class Command(JsonCommand):
    help = ("Create a demo operator, endpoint (+ credential), GitHub-style webhook and route; "
            "print a ready-to-paste .mcp.json and a curl that delivers a signed sample event.")

    def add_arguments(self, parser):
        parser.add_argument("--operator", default="demo", help="operator username (default demo)")
        parser.add_argument("--password", help="set this password for the operator (board and admin sign-in); "
                                 "default: generate one when the account has none (printed once)")
        parser.add_argument("--endpoint", default="demo-agent", help="endpoint slug")
        parser.add_argument("--webhook", default="demo-hook", help="webhook slug")
        parser.add_argument("--rotate", action="store_true",
                            help="mint a new demo credential and revoke the earlier ones at once "
                                 "(default: reuse the one earlier runs printed)")

    def handle(self, *args, operator, password, endpoint, webhook, rotate, **options):
        with transaction.atomic():
            user, new_password = self.find_or_create_operator(operator, password)
            agent_endpoint = self.find_or_vend_endpoint(endpoint, user)
            credential = ensure_demo_credential(agent_endpoint, rotate=rotate)
            hook = self.find_or_create_webhook(webhook, user)
            if not Route.objects.filter(webhook=hook, endpoint=agent_endpoint,
                                        queue=DEMO_QUEUE).exists():
                # Every paste of the sample is about issue #1: "new" makes each its own
                # todo, as the README's first five minutes promise, not a follow-up.
                transitions.add_webhook_route(webhook=hook, endpoint=agent_endpoint,
                                              queue=DEMO_QUEUE, follow_ups="new")
        base = settings.SWITCHBOARD_PUBLIC_URL
        mcp_url = f"{base}/mcp/{agent_endpoint.slug}"
        hook_url = f"{base}/hooks/{hook.slug}"
        mcp_json = connect_snippets.mcp_json(mcp_url)
        curl = build_curl(hook_url, hook.secret)
        data = {
            "operator": user.get_username(), "endpoint": agent_endpoint.slug, "mcp_url": mcp_url,
            "credential": credential, "webhook": hook.slug, "hook_url": hook_url,
            "secret": hook.secret, "mcp_json": mcp_json, "curl": curl,
        }
        username = user.get_username()
        if new_password:
            sign_in = f"generated password (shown only now): {new_password}"
        elif password:
            sign_in = "password as given"
        else:
            sign_in = f"password unchanged (reset it: manage.py changepassword {username})"
        if options.get("json") and new_password:
            # Not a documented key: the JSON object keeps exactly its documented keys, the hint goes
            # aside.
            self.stderr.write(f"seed_demo: operator {username} password (shown only now): "
                              f"{new_password}")
        self.emit(options, data, "\n".join([
            f"operator {username}: sign in at {base}/admin/ or {base}/todos/",
            f"  {sign_in}",
            f"endpoint {agent_endpoint.slug}: {mcp_url}",
            f"webhook {hook.slug} (github): {hook_url}",
            "", "re-runs print the same credential; --rotate replaces it.",
            connect_snippets.connect_text(mcp_url, credential),
            "", "deliver a signed sample event:", curl,
            "", f"then watch it on {base}/todos/",
        ]))

    def find_or_create_operator(self, username, password):
        """Returns ``(user, generated password or None)``."""
        User = get_user_model()
        user, _ = User.objects.get_or_create(username=username)
        generated = None
        if password:
            user.set_password(password)
        elif not user.password or not user.has_usable_password():
            generated = secrets.token_urlsafe(12)
            user.set_password(generated)
        user.is_staff = True  # /admin/ for their own rows; never made a superuser here
        user.save()
        user.user_permissions.add(
            *Permission.objects.filter(content_type__app_label__in=DEMO_ADMIN_APPS))
        return user, generated

    def find_or_vend_endpoint(self, slug, owner):
        existing = Endpoint.objects.filter(slug=slug).first()
        if existing is None:
            return endpoint_transitions.vend_endpoint(slug=slug, owner=owner)[0]
        if existing.owner_id != owner.pk:
            raise CommandError(f"endpoint {slug!r} exists and belongs to someone else")
        return existing

    def find_or_create_webhook(self, slug, owner):
        existing = Webhook.objects.filter(slug=slug).first()
        if existing is None:
            hook, _ = transitions.create_webhook(slug=slug, owner=owner, source=Source.GITHUB)
            return hook
        if existing.owner_id != owner.pk or existing.source != Source.GITHUB:
            raise CommandError(f"webhook {slug!r} exists and is not this operator's github webhook")
        return existing
