"""Bearer tokens: who is calling, and what they may touch.

Rule: a token is never logged, never put in an error message, and never
compared with ``==``. Each presented token is hashed and compared with
:func:`hmac.compare_digest` against *every* configured token, so the time an
answer takes reveals neither the token nor which principal it belongs to.

Two kinds of principal:

- the **admin** (``SCHED_ADMIN_TOKEN``) reads and writes everything;
- a **node** (``SCHED_NODE_TOKENS="node-a=tok1,node-b=tok2"``) reads only its
  own schedules.

Tokens may also come from a TOML or JSON file named by ``SCHED_TOKENS_FILE``::

    admin = ["admin-token-1", "admin-token-2"]   # or one string
    [nodes]
    node-a = "tok1"
    node-b = ["tok2", "tok2-next"]                # several, for rotation

The file and the environment are merged. A token that maps to two principals
is a configuration error, as is an empty token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sched_core.errors import ConfigError

log = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "SCHED_ADMIN_TOKEN"
NODE_TOKENS_ENV = "SCHED_NODE_TOKENS"
TOKENS_FILE_ENV = "SCHED_TOKENS_FILE"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the admin (``node`` is None) or one node."""

    node: str | None

    @property
    def is_admin(self) -> bool:
        """True for the admin, who reads and writes everything."""
        return self.node is None

    @property
    def label(self) -> str:
        """Return a name for logs: ``admin`` or ``node:<name>`` (never the token)."""
        return "admin" if self.node is None else f"node:{self.node}"

    def may_read_node(self, node: str) -> bool:
        """Return whether this caller may read the schedules of node."""
        return self.node is None or self.node == node


ADMIN = Principal(node=None)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class Tokens:
    """The configured tokens, held only as SHA-256 digests."""

    def __init__(
        self,
        admin: Iterable[str] = (),
        nodes: Mapping[str, Iterable[str]] | None = None,
        *,
        insecure: bool = False,
    ) -> None:
        entries: dict[bytes, Principal] = {}

        def add(token: str, principal: Principal) -> None:
            if not isinstance(token, str) or not token.strip():
                raise ConfigError(f"empty or non-string token for {principal.label}")
            digest = _digest(token.strip())
            if digest in entries and entries[digest] != principal:
                raise ConfigError(
                    f"one token is configured for both {entries[digest].label} "
                    f"and {principal.label}"
                )
            entries[digest] = principal

        for token in admin:
            add(token, ADMIN)
        for node, node_tokens in (nodes or {}).items():
            if not node or not node.strip():
                raise ConfigError("a node token has an empty node name")
            for token in node_tokens:
                add(token, Principal(node=node.strip()))
        self._entries = list(entries.items())
        self.insecure = insecure

    @property
    def has_admin(self) -> bool:
        """True when at least one admin token is configured."""
        return any(p.is_admin for _, p in self._entries)

    @property
    def nodes(self) -> list[str]:
        """Return the node names that have a token, sorted."""
        return sorted({p.node for _, p in self._entries if p.node is not None})

    def authenticate(self, token: str | None) -> Principal | None:
        """Return the principal a token belongs to, or None for an unknown token.

        With ``insecure`` set, every caller is the admin, token or not.
        """
        if self.insecure:
            return ADMIN
        if not token:
            return None
        presented = _digest(token)
        found: Principal | None = None
        # No early exit: every configured digest is compared, whatever matches.
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        return found

    def signer(self, message: bytes, signature: bytes) -> Principal | None:
        """Return the principal whose token signed message, or None (see :func:`sign`).

        Every configured token is tried, in constant time each, with no early
        exit. A token removed from the configuration no longer signs anything.
        """
        found: Principal | None = None
        for digest, principal in self._entries:
            expected = hmac.new(digest, message, hashlib.sha256).digest()
            if hmac.compare_digest(expected, signature):
                found = principal
        return found

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tokens:
        """Return the tokens named by the environment (admin, node list, tokens file)."""
        env = os.environ if environ is None else environ
        admin: list[str] = []
        nodes: dict[str, list[str]] = {}
        file_name = env.get(TOKENS_FILE_ENV, "").strip()
        if file_name:
            file_admin, file_nodes = load_tokens_file(Path(file_name))
            admin.extend(file_admin)
            for node, node_tokens in file_nodes.items():
                nodes.setdefault(node, []).extend(node_tokens)
        admin_token = env.get(ADMIN_TOKEN_ENV, "").strip()
        if admin_token:
            admin.append(admin_token)
        for node, token in parse_node_tokens(env.get(NODE_TOKENS_ENV, "")):
            nodes.setdefault(node, []).append(token)
        return cls(admin, nodes)


def sign(token: str, message: bytes) -> bytes:
    """Return message's HMAC-SHA256 keyed by the token's digest (:meth:`Tokens.signer` checks it).

    The fleet page's session cookie carries such a signature, never the token.
    """
    return hmac.new(_digest(token), message, hashlib.sha256).digest()


def parse_node_tokens(text: str) -> list[tuple[str, str]]:
    """Return (node, token) pairs from ``node-a=tok1,node-b=tok2``."""
    pairs: list[tuple[str, str]] = []
    for index, item in enumerate(text.split(","), start=1):
        item = item.strip()
        if not item:
            continue
        node, sep, token = item.partition("=")
        if not sep or not node.strip() or not token.strip():
            # The item may hold a token: say where it is, not what it is.
            raise ConfigError(
                f"{NODE_TOKENS_ENV}: item {index} is not of the form node=token"
            )
        pairs.append((node.strip(), token.strip()))
    return pairs


def _token_list(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ConfigError(f"{where} must be a token string or a list of token strings")


def load_tokens_file(path: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Return (admin tokens, node tokens) from a TOML or JSON file (by its suffix)."""
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read tokens file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("tokens file is readable by other users; chmod 600 it",
                    extra={"path": str(path), "mode": oct(stat.S_IMODE(mode))})
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        # The parser's message may quote a line of the file, that is, a token.
        raise ConfigError(f"tokens file {path} is not valid {path.suffix or 'TOML'}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"tokens file {path}: expected a table/object at the top")
    unknown = sorted(set(data) - {"admin", "nodes"})
    if unknown:
        raise ConfigError(f"tokens file {path}: unknown keys {unknown} (expected admin, nodes)")
    admin = _token_list(data.get("admin", []), f"tokens file {path}: admin")
    nodes_data = data.get("nodes", {})
    if not isinstance(nodes_data, dict):
        raise ConfigError(f"tokens file {path}: nodes must be a table of node = token")
    nodes = {
        str(node): _token_list(value, f"tokens file {path}: nodes.{node}")
        for node, value in nodes_data.items()
    }
    return admin, nodes


def bearer_token(authorization: str | None) -> str | None:
    """Return the token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
