"""Who the client is: the peer's address, or the address a trusted proxy forwarded.

Rule: ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are believed only from the
proxies listed in ``SCHED_TRUSTED_PROXIES`` (none by default), and then read from
the right: a proxy such as HAProxy (``option forwardfor``) appends the address it
got the request from to whatever the client sent, so the rightmost address that
is not a trusted proxy is the client, and anything left of it is the client's own
say (never believed). :class:`RealClientMiddleware` puts that address in the ASGI
scope's ``client``, so every layer after it (the login limit, the access log) sees
the real client. uvicorn's own proxy-header handling (which trusts ``127.0.0.1``
by default) is off (:func:`controller.server.uvicorn_config`).

Behind a proxy that is *not* listed, every client has the proxy's address: one
login limit for all of them. Requests that carry the header from an unlisted peer
are said in one WARNING line per :data:`UNTRUSTED_NOTICE_S` at most.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from controller.api.headers import HttpMiddleware
from controller.logtext import printable
from controller.settings import Network

log = logging.getLogger("controller.api")

UNTRUSTED_NOTICE_S = 3600.0
"""At most one line per this many seconds says that a forwarded header was ignored."""
IPV6_CLIENT_PREFIX = 64
"""An IPv6 client is counted by its /64 (one site's usual allocation), as one address."""


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Return an address of a header item (``1.2.3.4``, ``::1``, ``[::1]:80``), or None."""
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # an IPv4 address with a port
        text = text.partition(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def trusted(address: str, proxies: Sequence[Network]) -> bool:
    """Return whether address is one of the trusted proxies."""
    found = _address(address)
    return found is not None and any(found in network for network in proxies)


def forwarded_client(peer: str, forwarded_for: Sequence[str],
                     proxies: Sequence[Network]) -> str:
    """Return the client of a request from peer with these ``X-Forwarded-For`` values.

    Pure. Walk the addresses from the right (the nearest hop first) past the trusted
    proxies; the first other address is the client. An item that is not an address
    stops the walk: the hop that handed it over is the client.
    """
    if not trusted(peer, proxies):
        return peer
    client = peer
    items = [item for value in forwarded_for for item in value.split(",")]
    for item in reversed(items):
        found = _address(item)
        if found is None:
            break
        client = str(found)
        if not any(found in network for network in proxies):
            break
    return client


def client_key(address: str) -> str:
    """Return the key a per-client limit counts address by: itself, or its /64 for IPv6."""
    found = _address(address)
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is None:
        network = ipaddress.ip_network(f"{found}/{IPV6_CLIENT_PREFIX}", strict=False)
        return str(network)
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        return str(found.ipv4_mapped)
    return address[:100]


class RealClientMiddleware(HttpMiddleware):
    """Put the real client's address (and scheme) in the scope (the module's rule)."""

    def __init__(self, app: ASGIApp, proxies: Sequence[Network] = (), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(app)
        self.proxies = tuple(proxies)
        self.clock = clock
        self._noticed: float | None = None

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if client:
            forwarded = [value.decode("latin-1") for name, value in scope["headers"]
                         if name == b"x-forwarded-for"]
            if forwarded:
                peer = str(client[0])
                if trusted(peer, self.proxies):
                    scope["client"] = (forwarded_client(peer, forwarded, self.proxies), 0)
                    scheme = self._forwarded_scheme(scope)
                    if scheme is not None:
                        scope["scheme"] = scheme
                else:
                    self._notice(peer)
        await self.app(scope, receive, send)

    @staticmethod
    def _forwarded_scheme(scope: Scope) -> str | None:
        """Return the nearest proxy's ``X-Forwarded-Proto`` (http or https), or None."""
        values = [value.decode("latin-1") for name, value in scope["headers"]
                  if name == b"x-forwarded-proto"]
        if not values:
            return None
        last = values[-1].split(",")[-1].strip().lower()
        return last if last in ("http", "https") else None

    def _notice(self, peer: str) -> None:
        now = self.clock()
        if self._noticed is not None and now - self._noticed < UNTRUSTED_NOTICE_S:
            return
        self._noticed = now
        log.warning(
            "a request from %s carries X-Forwarded-For, which is ignored: %s is not a "
            "trusted proxy (SCHED_TRUSTED_PROXIES), so every client behind it is counted as "
            "%s (one login limit for all of them); at most one such line an hour",
            printable(peer), printable(peer), printable(peer), extra={"peer": printable(peer)})
