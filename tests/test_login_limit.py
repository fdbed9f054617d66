"""The fleet page's login limit counts the real client, on every instance at once.

Issue 36, point 11: 40 guesses from 127.0.0.1, each with another ``X-Forwarded-For``,
got no 429 (uvicorn believed the header from loopback), and each controller instance
counted alone. Over real HTTP to real uvicorn servers (controller.testing).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.api.client import client_key, forwarded_client
from controller.auth import Tokens
from controller.db import make_engine
from controller.settings import ControllerSettings, Network
from controller.testing import serve_in_thread
from sched_core.errors import ConfigError

ADMIN_TOKEN = "login-limit-admin-token-0123456789"
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@contextmanager
def controllers(url: str, count: int = 1,
                proxies: Sequence[Network] = ()) -> Iterator[list[httpx.Client]]:
    """Serve count controller instances on one database; yield a client to each."""
    engine = make_engine(url)
    try:
        with ExitStack() as stack:
            clients = []
            for _ in range(count):
                app = create_app(engine, Tokens(admin=[ADMIN_TOKEN]), trusted_proxies=proxies)
                base = stack.enter_context(serve_in_thread(app))
                clients.append(stack.enter_context(httpx.Client(base_url=base, timeout=30)))
            yield clients
    finally:
        engine.dispose()


def guess(client: httpx.Client, token: str, forwarded_for: str | None = None) -> int:
    headers = {"x-forwarded-for": forwarded_for} if forwarded_for else {}
    return client.post("/login", data={"token": token}, headers=headers).status_code


def test_forwarded_for_from_loopback_is_not_believed_unless_configured(sqlite_url: str) -> None:
    """Before: 40 guesses with 40 forged addresses were 40 x 401 (no 429)."""
    with controllers(sqlite_url) as (http,):
        answers = [guess(http, f"guess-{i}", f"10.9.0.{i}") for i in range(40)]
    assert answers == [401] * 10 + [429] * 30


def test_behind_a_trusted_proxy_a_guesser_cannot_lock_the_admin_out(sqlite_url: str) -> None:
    """The proxy (loopback here) appends the address it got the request from; the guesser
    forges the admin's address to the left of it: only its own address is counted."""
    with controllers(sqlite_url, proxies=LOOPBACK) as (http,):
        answers = [guess(http, f"guess-{i}", "10.0.0.1, 10.0.0.66") for i in range(20)]
        assert answers == [401] * 10 + [429] * 10
        assert guess(http, "guess", "10.0.0.66") == 429
        # The admin, behind the same proxy at its own address, logs in.
        assert guess(http, ADMIN_TOKEN, "10.0.0.1") == 303
        # A direct client (no header) is the proxy's address: counted alone too.
        assert guess(http, "guess-direct") == 401


def test_the_limit_is_shared_by_every_instance(database_url: str) -> None:
    """Before: each instance counted alone, so two instances let 20 guesses through."""
    with controllers(database_url, count=2) as (first, second):
        answers = [guess((first, second)[i % 2], f"guess-{i}") for i in range(24)]
        assert answers == [401] * 10 + [429] * 14
        refused = second.post("/login", data={"token": ADMIN_TOKEN})
    assert refused.status_code == 429  # the right token waits too: it is not even tried
    assert 1 <= int(refused.headers["retry-after"]) <= 60


@pytest.mark.parametrize(("peer", "header", "client"), [
    ("10.0.0.5", ["1.2.3.4"], "10.0.0.5"),                       # not a proxy: ignored
    ("127.0.0.1", ["1.2.3.4"], "1.2.3.4"),
    ("127.0.0.1", ["6.6.6.6, 1.2.3.4"], "1.2.3.4"),              # the client's own say: no
    ("127.0.0.1", ["1.2.3.4, 127.0.0.2"], "1.2.3.4"),            # two proxies
    ("127.0.0.1", ["1.2.3.4", "127.0.0.2"], "1.2.3.4"),          # two header lines
    ("127.0.0.1", ["not-an-address, 1.2.3.4"], "1.2.3.4"),
    ("127.0.0.1", ["1.2.3.4, garbage"], "127.0.0.1"),            # stops at what it cannot read
    ("127.0.0.1", ["[2001:db8::1]:443"], "2001:db8::1"),
    ("127.0.0.1", ["127.0.0.3"], "127.0.0.3"),                   # only proxies: the farthest
])
def test_the_client_is_the_rightmost_address_that_is_not_a_trusted_proxy(
    peer: str, header: list[str], client: str,
) -> None:
    assert forwarded_client(peer, header, LOOPBACK) == client


def test_an_ipv6_client_is_counted_by_its_64() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert client_key("10.1.2.3") == "10.1.2.3"


def test_trusted_proxies_are_read_and_a_bad_one_is_named() -> None:
    environ: dict[str, Any] = {"SCHED_TRUSTED_PROXIES": "127.0.0.1, 10.0.0.0/8,::1"}
    networks = ControllerSettings.read(environ).proxy_networks()
    assert [str(n) for n in networks] == ["127.0.0.1/32", "10.0.0.0/8", "::1/128"]
    assert ControllerSettings.read({}).proxy_networks() == ()
    with pytest.raises(ConfigError, match=r"SCHED_TRUSTED_PROXIES: 'haproxy\.local' is not an "
                                          r"IP address or network"):
        ControllerSettings.read({"SCHED_TRUSTED_PROXIES": "127.0.0.1,haproxy.local"})
