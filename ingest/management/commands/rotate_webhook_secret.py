from datetime import timedelta

from django.core.management.base import CommandError

from ingest import sender_setup, senders, transitions
from ingest.models import Webhook
from switchboard.commands import JsonCommand


# A grace longer than a month is a rotation that never finishes (and a huge number overflowed
# the date arithmetic into a traceback).
MAX_GRACE_SECONDS = 30 * 24 * 3600


class Command(JsonCommand):
    help = ("Mint a new secret for a webhook and print it (shown only now), or install the one "
            "the sender minted (--secret: Slack, Linear, Sentry and Stripe make their own); the "
            "old one keeps verifying for --grace-seconds (default 24 h; 0 ends it at once).")

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--grace-seconds", type=int,
                            default=int(transitions.DEFAULT_SECRET_ROTATION_GRACE.total_seconds()))
        parser.add_argument("--secret", help="install this secret (the sender's new one) "
                                             "instead of minting one")

    def handle(self, *args, slug, grace_seconds, secret=None, **options):
        if not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
            raise CommandError(f"--grace-seconds must be between 0 and {MAX_GRACE_SECONDS} "
                               "(30 days)")
        webhook = Webhook.objects.filter(slug=slug).first()
        if webhook is None:
            raise CommandError(f"no webhook {slug!r}")
        if not senders.get_sender(webhook.source).signed:
            raise CommandError(f"webhook {slug!r} is unsigned; it has no secret to rotate")
        if webhook.source in sender_setup.SENDER_MINTED and not secret:
            # A minted secret would be one the sender can never sign with.
            raise CommandError(
                f"{webhook.source} mints its signing secret itself: roll it at {webhook.source} "
                f"and pass the new one: rotate_webhook_secret {slug} --secret '…'")
        try:
            secret = transitions.rotate_webhook_secret(webhook, secret=secret,
                                                       grace=timedelta(seconds=grace_seconds))
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        grace = (f"the old one verifies for {grace_seconds} s more" if grace_seconds
                 else "the old one no longer verifies")
        where = ("installed" if webhook.source in sender_setup.SENDER_MINTED
                 else "configure it at the sender")
        self.emit(options, {"slug": slug, "secret": secret},
                  f"new secret for {slug}: {secret}\n({where}; {grace})")
