"""switchboard/http/client_address.py: X-Forwarded-For is believed only from a trusted proxy."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from switchboard.http.client_address import find_client_address, scope_with_client_address


def test_without_trusted_proxies_the_header_is_ignored(settings):
    settings.SWITCHBOARD_TRUSTED_PROXIES = []
    assert find_client_address("198.51.100.7", "127.0.0.1") == "198.51.100.7"
    assert find_client_address(None, "127.0.0.1") == "unix"


def test_behind_a_trusted_proxy_the_rightmost_untrusted_hop_is_the_client(settings):
    settings.SWITCHBOARD_TRUSTED_PROXIES = ["127.0.0.1", "10.0.0.0/8"]
    # nginx appends the address it saw; what the client wrote itself stays to the left.
    assert find_client_address("127.0.0.1", "127.0.0.1, 203.0.113.9") == "203.0.113.9"
    assert find_client_address("127.0.0.1", "203.0.113.9, 10.1.2.3") == "203.0.113.9"
    # A direct (untrusted) peer cannot choose its address by sending the header.
    assert find_client_address("203.0.113.9", "127.0.0.1") == "203.0.113.9"
    assert find_client_address("127.0.0.1", "") == "127.0.0.1"


def test_the_scope_carries_the_client_behind_a_trusted_proxy(settings):
    settings.SWITCHBOARD_TRUSTED_PROXIES = ["127.0.0.1"]
    two_headers = {"client": ("127.0.0.1", 5), "headers": [
        (b"x-forwarded-for", b"1.1.1.1"), (b"X-Forwarded-For", b"203.0.113.9")]}
    assert scope_with_client_address(two_headers)["client"] == ("203.0.113.9", 0)
    direct = {"client": ("198.51.100.7", 5), "headers": [(b"x-forwarded-for", b"127.0.0.1")]}
    assert scope_with_client_address(direct) is direct
    settings.SWITCHBOARD_TRUSTED_PROXIES = []
    assert scope_with_client_address(two_headers) is two_headers


def test_a_unix_socket_peer_is_trusted_only_when_named(settings):
    scope = {"client": None, "headers": [(b"x-forwarded-for", b"203.0.113.9")]}
    settings.SWITCHBOARD_TRUSTED_PROXIES = ["127.0.0.1"]
    assert scope_with_client_address(scope)["client"] is None
    settings.SWITCHBOARD_TRUSTED_PROXIES = ["unix"]
    assert scope_with_client_address(scope)["client"] == ("203.0.113.9", 0)


def test_a_bad_trusted_proxy_entry_names_the_setting(settings):
    settings.SWITCHBOARD_TRUSTED_PROXIES = ["not-an-address"]
    with pytest.raises(ImproperlyConfigured, match="SWITCHBOARD_TRUSTED_PROXIES"):
        find_client_address("127.0.0.1", "")


def test_a_loopback_peer_forwarding_while_no_proxy_is_trusted_is_logged_once(settings, caplog,
                                                                             monkeypatch):
    """A tunnel or proxy on the same machine that nobody named: every client is 127.0.0.1."""
    from switchboard.http import client_address

    monkeypatch.setattr(client_address, "_untrusted_forwarding_logged", False)
    settings.SWITCHBOARD_TRUSTED_PROXIES = []
    forwarded = [(b"x-forwarded-for", b"203.0.113.9")]
    quiet = [{"client": ("127.0.0.1", 5), "headers": []},
             {"client": ("198.51.100.7", 5), "headers": forwarded}]
    for scope in quiet:
        assert scope_with_client_address(scope) is scope
    assert not caplog.records
    for _ in range(3):
        tunnelled = {"client": ("127.0.0.1", 5), "headers": forwarded}
        assert scope_with_client_address(tunnelled) is tunnelled  # still the peer
    [record] = caplog.records
    assert "SWITCHBOARD_TRUSTED_PROXIES is unset" in record.getMessage()
