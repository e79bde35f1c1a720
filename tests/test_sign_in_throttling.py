"""Sign-in is throttled per (username, client address) pair on both login views: after enough
wrong passwords for a username from an address, the right one fails too from there, for a
while, and nobody can lock an operator out from elsewhere."""

import re
from datetime import timedelta

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client

from tests.factories import UserFactory
from tests.servers import REPO_ROOT

pytestmark = pytest.mark.django_db

LOGIN_VIEWS = ("/accounts/login/", "/admin/login/")
RIGHT = "correct horse battery staple"


def sign_in(path, username, password, address="203.0.113.7"):
    client = Client(REMOTE_ADDR=address)
    response = client.post(path, {"username": username, "password": password, "next": "/todos/"})
    return response, client


def signed_in(response, client) -> bool:
    return response.status_code == 302 and settings.SESSION_COOKIE_NAME in client.cookies


@pytest.fixture
def alice():
    return UserFactory(username="alice", password=RIGHT, is_staff=True, is_superuser=True)


def test_the_right_password_signs_in_on_both_views(alice):
    for path in LOGIN_VIEWS:
        assert signed_in(*sign_in(path, "alice", RIGHT))


def test_twenty_wrong_passwords_lock_that_username_out_from_that_address(alice):
    for attempt in range(20):
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", f"wrong-{attempt}", address="198.51.100.9")
    for path in LOGIN_VIEWS:
        response, client = sign_in(path, "alice", RIGHT, address="198.51.100.9")
        assert not signed_in(response, client), path
        assert response.status_code == 429


def test_nobody_can_lock_an_operator_out_from_elsewhere(alice):
    bob = UserFactory(username="bob", password=RIGHT)
    # Someone guesses alice's password, from one address and from many.
    for attempt in range(20):
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", f"wrong-{attempt}", address="198.51.100.9")
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", "wrong", address=f"198.51.100.{100 + attempt}")
    # Alice, from her own address, still signs in on both views...
    for path in LOGIN_VIEWS:
        assert signed_in(*sign_in(path, "alice", RIGHT, address="192.0.2.1")), path
    # ...and so does anyone else from the guesser's address.
    assert signed_in(*sign_in("/accounts/login/", bob.username, RIGHT, address="198.51.100.9"))


def test_the_lockout_ends_after_the_cool_off(alice):
    from axes.models import AccessAttempt

    for attempt in range(20):
        sign_in("/accounts/login/", "alice", "wrong")
    assert not signed_in(*sign_in("/admin/login/", "alice", RIGHT))
    AccessAttempt.objects.update(
        attempt_time=AccessAttempt.objects.first().attempt_time - settings.AXES_COOLOFF_TIME
        - timedelta(seconds=1))
    assert signed_in(*sign_in("/admin/login/", "alice", RIGHT))


@pytest.mark.parametrize("password", ["password", "12345678", "alice-alice", "short"])
def test_djangos_standard_password_validators_are_on(password):
    user = UserFactory.build(username="alice-alice", email="alice-alice@example.com")
    with pytest.raises(ValidationError):
        validate_password(password, user)
    validate_password("a much longer passphrase, 2026", user)


# -- through the real server: the address is the peer's, or a trusted hop's X-Forwarded-For ----
#
# daphne on loopback sees every request from 127.0.0.1, as it does behind a reverse proxy or
# a tunnel on the same machine; X-Forwarded-For is what a tunnel adds (or an attacker writes).

TUNNEL_SECTION = "## Reaching this machine through a tunnel"
ATTACKER = "203.0.113.9"
OPERATOR_ELSEWHERE = "192.0.2.1"


def tunnel_recipe_environment() -> dict:
    """The settings docs/senders.md's tunnel recipe exports, but its public URL (the tunnel's
    own address): ``{}`` if it sets none."""
    text = (REPO_ROOT / "docs" / "senders.md").read_text()
    if TUNNEL_SECTION not in text:
        return {}
    section = text.split(TUNNEL_SECTION, 1)[1].split("\n## ", 1)[0]
    exports = re.findall(r"^export (\w+)=(\S+)", section, re.MULTILINE)
    return {name: value for name, value in exports if name != "SWITCHBOARD_PUBLIC_URL"}


def operator_for_a_server():
    """alice, with a password the server's own hasher reads (the test settings' fast MD5 is
    the test process's alone)."""
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    alice = UserFactory(username="alice", is_staff=True, is_superuser=True)
    alice.password = PBKDF2PasswordHasher().encode(RIGHT, "tunnel-test-salt")
    alice.save(update_fields=["password"])
    return alice


def sign_in_over_http(server, username, password, forwarded_for=None) -> int:
    """One sign-in on the real server: the status (302 signed in, 200 wrong password, 429
    locked out)."""
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        page = http.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        answer = http.post("/accounts/login/", data={
            "username": username, "password": password, "next": "/todos/",
            "csrfmiddlewaretoken": token})
        return answer.status_code


@pytest.mark.django_db(transaction=True)
def test_ten_bad_passwords_through_the_docs_tunnel_do_not_lock_out_the_operators_own_address(
        start_daphne):
    """The docs' recipe for exposing the embedded default: a tunnel on the same machine, so
    every request reaches daphne from 127.0.0.1, the internet's with X-Forwarded-For. Ten bad
    passwords from the internet lock out that address, never the operator at the machine
    (127.0.0.1, no header) or the operator arriving through the tunnel from elsewhere."""
    operator_for_a_server()
    recipe = tunnel_recipe_environment()
    server = start_daphne(**recipe)
    # The tenth failure already answers 429: that pair is locked out from then on.
    assert {sign_in_over_http(server, "alice", f"wrong-{attempt}", ATTACKER)
            for attempt in range(10)} <= {200, 429}
    assert sign_in_over_http(server, "alice", RIGHT, ATTACKER) == 429, recipe
    assert sign_in_over_http(server, "alice", RIGHT) == 302, recipe
    assert sign_in_over_http(server, "alice", RIGHT, OPERATOR_ELSEWHERE) == 302, recipe


@pytest.mark.django_db(transaction=True)
def test_a_forged_forwarded_address_picks_nothing_with_or_without_trusted_hops(start_daphne):
    """No hop trusted: X-Forwarded-For is ignored, so rotating it neither dodges the lockout
    nor frames another address. The hop 127.0.0.1 trusted: only the right-most address the
    hop appended counts; what a client wrote to its left (the operator's address) does not."""
    operator_for_a_server()
    direct = start_daphne()
    for attempt in range(10):
        sign_in_over_http(direct, "alice", f"wrong-{attempt}", f"198.51.100.{attempt}")
    assert sign_in_over_http(direct, "alice", RIGHT, "198.51.100.200") == 429
    direct.stop()
    from axes.models import AccessAttempt

    AccessAttempt.objects.all().delete()
    behind_a_hop = start_daphne(SWITCHBOARD_TRUSTED_PROXIES="127.0.0.1")
    for attempt in range(10):
        sign_in_over_http(behind_a_hop, "alice", f"wrong-{attempt}",
                          f"{OPERATOR_ELSEWHERE}, 127.0.0.1, {ATTACKER}")
    assert sign_in_over_http(behind_a_hop, "alice", RIGHT, ATTACKER) == 429
    assert sign_in_over_http(behind_a_hop, "alice", RIGHT, OPERATOR_ELSEWHERE) == 302
    assert sign_in_over_http(behind_a_hop, "alice", RIGHT) == 302


def test_the_lockout_reads_the_asgi_client_address_never_a_header():
    """django-axes would read X-Forwarded-For itself (django-ipware) were that package ever
    installed beside it; the address is the one the ASGI entry point settled on."""
    from axes.helpers import get_client_ip_address
    from django.test import RequestFactory

    request = RequestFactory().post("/accounts/login/", REMOTE_ADDR="127.0.0.1",
                                    HTTP_X_FORWARDED_FOR=ATTACKER, HTTP_X_REAL_IP=ATTACKER)
    assert get_client_ip_address(request, use_ipware=True) == "127.0.0.1"
