from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints import queries, transitions
from endpoints.models import Credential

pytestmark = pytest.mark.django_db


def test_a_credential_opens_only_its_own_active_endpoint(operator):
    endpoint, credential = transitions.vend_endpoint(slug="one", owner=operator)
    other, other_credential = transitions.vend_endpoint(slug="two", owner=operator)
    assert queries.find_endpoint_for_credential("one", credential) == endpoint
    assert queries.find_endpoint_for_credential("two", credential) is None
    assert queries.find_endpoint_for_credential("one", other_credential) is None
    assert queries.find_endpoint_for_credential("one", credential + "x") is None
    assert queries.find_endpoint_for_credential("one", "") is None
    endpoint.active = False
    endpoint.save()
    assert queries.find_endpoint_for_credential("one", credential) is None


def test_only_the_digest_is_stored(operator):
    _, credential = transitions.vend_endpoint(slug="one", owner=operator)
    assert credential.startswith("sbk_") and len(credential) > 40
    row = Credential.objects.get()
    assert credential not in (row.digest, row.hint) and len(row.hint) < len(credential)


def test_rotation_grace_expires_the_old_credential(operator):
    endpoint, old = transitions.vend_endpoint(slug="one", owner=operator)
    now = timezone.now()
    new = transitions.rotate_credential(endpoint, grace=timedelta(minutes=10), now=now)
    later = now + timedelta(minutes=9)
    assert queries.find_endpoint_for_credential("one", old, now=later) == endpoint
    expired = now + timedelta(minutes=11)
    assert queries.find_endpoint_for_credential("one", old, now=expired) is None
    assert queries.find_endpoint_for_credential("one", new, now=expired) == endpoint


def test_effective_lease_prefers_the_endpoint_default(operator, settings):
    endpoint, _ = transitions.vend_endpoint(slug="one", owner=operator)
    assert endpoint.effective_lease == settings.SWITCHBOARD_DEFAULT_LEASE
    endpoint.default_lease_seconds = 90
    assert endpoint.effective_lease == timedelta(seconds=90)


def test_the_endpoint_found_by_credential_reads_like_the_orms(operator):
    # The lookup builds the row itself (raw SQL; psycopg's own loaders on PostgreSQL, converters
    # applied by hand on SQLite): every field must come back as the ORM reads it, JSON and
    # datetimes included.
    endpoint, credential = transitions.vend_endpoint(
        slug="one", owner=operator, scope=["inbox", "ops"], verbs=["claim_next", "complete"],
        default_lease_seconds=90)
    endpoint.shift_timezone = "Europe/Berlin"
    endpoint.shift_schedule = [{"day": "mon", "start": "09:00", "end": "17:00"}]
    endpoint.presence_override, endpoint.presence_override_until = "out", timezone.now()
    endpoint.save()
    found = queries.find_endpoint_for_credential("one", credential)
    expected = type(endpoint).objects.get(pk=endpoint.pk)
    for field in type(endpoint)._meta.concrete_fields:
        assert getattr(found, field.attname) == getattr(expected, field.attname), field.name
    assert found.owner == operator


def test_the_endpoint_found_by_credential_is_a_saved_instance_and_init_signals_still_fire(
        operator):
    # On PostgreSQL the row becomes an Endpoint without Model.__init__ (statements.
    # instance_from_loaded_row); anything listening for the model's init signals gets them.
    from django.db.models.signals import post_init

    from endpoints.models import Endpoint

    _, credential = transitions.vend_endpoint(slug="one", owner=operator)
    found = queries.find_endpoint_for_credential("one", credential)
    assert found._state.adding is False and found._state.db == "default"
    found.save(update_fields=["presence_state"])  # an UPDATE of the row, not an INSERT
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(receiver, sender=Endpoint)
    try:
        again = queries.find_endpoint_for_credential("one", credential)
    finally:
        post_init.disconnect(receiver, sender=Endpoint)
    assert seen == [again]


def test_the_bearer_lookup_is_prepared_after_a_few_runs(db):
    """Every MCP request runs it: PostgreSQL plans it once per connection, not per request."""
    from django.db import connection

    from endpoints import queries, transitions
    from tests.factories import UserFactory

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no prepared statements to look for; the PostgreSQL pass checks this")
    endpoint, credential = transitions.vend_endpoint(slug="prepared", owner=UserFactory())
    for _ in range(6):
        assert queries.find_endpoint_for_credential("prepared", credential) == endpoint
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [statement for (statement,) in cursor.fetchall()]
    assert any("FROM endpoints_credential c" in statement for statement in prepared), prepared
