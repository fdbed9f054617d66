"""Bearer tokens: who is calling, and what they may touch.

Rule: a token is never logged, never put in an error message, and never compared with
``==``. Each presented token is hashed (SHA-256) and its digest looked up among the
configured tokens' digests: one lookup whatever their number, whose time can depend only on
the digest, which tells an attacker nothing without a preimage.

Two kinds of principal: the **admin** (``SCHED_ADMIN_TOKEN``) reads and writes everything;
a **node** (``SCHED_NODE_TOKENS="node-a=tok1,node-b=tok2"``) reads only its own schedules.
Tokens may also come from a TOML or JSON file named by ``SCHED_TOKENS_FILE``::

    admin = ["admin-token-1", "admin-token-2"]   # or one string
    [nodes]
    node-a = "tok1"
    node-b = ["tok2", "tok2-next"]                # several, for rotation

The file and the environment are merged. A token that maps to two principals, an empty
token, and a tokens file its group or other users may read or write are configuration
errors. The file is reloaded while the controller runs (:class:`TokensReloader`), when it
changes on disk or on ``SIGHUP``; a new file that fails to load keeps the tokens in force
and logs an error naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from controller.settings import ControllerSettings
from sched_core.errors import ConfigError
from sched_core.worker import Running

log = logging.getLogger(__name__)

MIN_TOKEN_LENGTH = 16
"""The shortest token served without a warning (characters): ``openssl rand -hex 32`` gives 64."""

ADMIN_TOKEN_ENV = ControllerSettings.env_name("admin_token")
NODE_TOKENS_ENV = ControllerSettings.env_name("node_tokens")
TOKENS_FILE_ENV = ControllerSettings.env_name("tokens_file")


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
        short: dict[str, int] = {}

        def add(token: str, principal: Principal) -> None:
            if not isinstance(token, str) or not token.strip():
                raise ConfigError(f"empty or non-string token for {principal.label}")
            length = len(token.strip())
            if length < MIN_TOKEN_LENGTH:
                short[principal.label] = min(length, short.get(principal.label, length))
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
        self._index = entries
        self.insecure = insecure
        self.short = short
        """Each principal with a token shorter than MIN_TOKEN_LENGTH, and its shortest length."""

    def warn_short(self) -> None:
        """Log a WARNING per principal with a token under MIN_TOKEN_LENGTH (never the token)."""
        for label, length in sorted(self.short.items()):
            log.warning(
                "the %s token is %d characters long, under the minimum of %d: anyone who can "
                "reach the API can guess it; use a long random one (openssl rand -hex 32)",
                label, length, MIN_TOKEN_LENGTH)

    def replace_with(self, other: Tokens) -> None:
        """Take other's tokens in place of these, at once (a reload).

        Each reader reads one attribute, which is rebound whole, so a request being
        authenticated meanwhile sees either the old tokens or the new ones, never a mix.
        """
        self._index = other._index
        self._entries = other._entries

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
        # One lookup by the token's SHA-256 digest (the module's rule): self._index is
        # read once, and a reload rebinds it, never changes it.
        return self._index.get(_digest(token))

    def node_keys(self, node: str) -> list[bytes]:
        """Return the digests of node's tokens: the keys its vouchers are signed with
        (:mod:`sched_core.vouchers`)."""
        return [digest for digest, principal in self._entries if principal.node == node]

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
        """Return the tokens named by the environment (admin, node list, tokens file).

        ``environ`` (default: the process's) is read as :class:`ControllerSettings`.
        """
        settings = ControllerSettings.read(environ)
        admin: list[str] = []
        nodes: dict[str, list[str]] = {}
        file_name = settings.tokens_file.strip()
        if file_name:
            file_admin, file_nodes = load_tokens_file(Path(file_name))
            admin.extend(file_admin)
            for node, node_tokens in file_nodes.items():
                nodes.setdefault(node, []).extend(node_tokens)
        admin_token = settings.admin_token.get_secret_value().strip()
        if admin_token:
            admin.append(admin_token)
        for node, token in parse_node_tokens(settings.node_tokens.get_secret_value()):
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


OPEN_TO_OTHERS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH
"""Mode bits that refuse a tokens file: read or write by its group or anyone else."""


def open_to(mode: int) -> str:
    """Say who besides the owner may read or write a file of this mode, e.g. ``group may read``."""
    said = []
    for who, read, write in (("group", stat.S_IRGRP, stat.S_IWGRP),
                             ("others", stat.S_IROTH, stat.S_IWOTH)):
        can = [verb for verb, bit in (("read", read), ("write", write)) if mode & bit]
        if can:
            said.append(f"{who} may {' and '.join(can)}")
    return ", ".join(said) or "owner only"


def _token_list(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ConfigError(f"{where} must be a token string or a list of token strings")


def load_tokens_file(path: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Return (admin tokens, node tokens) from a TOML or JSON file (by its suffix)."""
    try:
        with path.open("rb") as handle:  # the mode checked is the file's that is read
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read tokens file {path}: {exc.strerror}") from exc
    if mode & OPEN_TO_OTHERS:
        raise ConfigError(
            f"tokens file {path} is open to other users ({open_to(mode)}; "
            f"mode {stat.S_IMODE(mode):04o}): chmod 600 {path}"
        )
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


class TokensReloader(Running):
    """Reload the tokens file into the live :class:`Tokens` when it changes, or on request.

    Rule: one mechanism for both. A thread wakes every ``interval`` seconds
    (never, with 0: then only on request), or at once when :meth:`request` is
    called (the ``SIGHUP`` handler does only that), and calls :meth:`check`: it
    stats the file and reloads it when its modification time, size, inode or
    mode changed since the last look, or when a reload was requested.

    A reload builds the whole token set again (the environment read at start,
    plus the file) and puts it in force at once. A file that fails to load
    (missing, unreadable, open to other users, not valid TOML/JSON, a token for
    two principals, or no admin token left when one is required) keeps the
    tokens in force and logs one error naming the file and the problem; an
    unchanged bad file is not reported again until it changes or is requested.
    Never a token in a log line: only counts.
    """

    def __init__(
        self,
        tokens: Tokens | None,
        environ: Mapping[str, str] | None = None,
        *,
        interval: float = 2.0,
        require_admin: bool = True,
    ) -> None:
        if not interval >= 0:
            raise ValueError(
                f"interval must be 0 or a positive number of seconds, got {interval!r}"
            )
        self.tokens = tokens
        self.environ = dict(os.environ if environ is None else environ)
        file_name = ControllerSettings.read(self.environ).tokens_file.strip()
        self.path = Path(file_name) if file_name and tokens is not None else None
        self.interval = interval
        self.require_admin = require_admin
        self.reloads = 0
        self.failures = 0
        self._seen = self._signature()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _signature(self) -> tuple[int, ...] | str | None:
        """Return what identifies the file's version: (mtime, size, inode, mode), or the error."""
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_ctime_ns)

    def request(self) -> None:
        """Ask for a reload now (safe in a signal handler: it only sets an event)."""
        self._wake.set()

    def check(self, *, force: bool = False) -> bool | None:
        """Reload if the file changed (or force): True reloaded, False refused, None no change."""
        if self.path is None or self.tokens is None:
            if force:
                log.info("nothing to reload: no tokens file (%s is not set)", TOKENS_FILE_ENV)
            return None
        signature = self._signature()
        if not force and signature == self._seen:
            return None
        self._seen = signature
        try:
            fresh = Tokens.from_env(self.environ)
            if self.require_admin and not fresh.has_admin:
                raise ConfigError(
                    f"tokens file {self.path}: no admin token left (in the file or "
                    f"{ADMIN_TOKEN_ENV})"
                )
        except ConfigError as exc:
            self.failures += 1
            log.error("tokens file %s not reloaded; the tokens in force are kept: %s",
                      self.path, exc)
            return False
        self.tokens.replace_with(fresh)
        fresh.warn_short()
        self.reloads += 1
        log.info("tokens file reloaded", extra={
            "path": str(self.path), "admin_tokens": sum(p.is_admin for _, p in fresh._entries),
            "nodes": len(fresh.nodes), "requested": force,
        })
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            requested = self._wake.wait(self.interval or None)  # 0: on request only
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check(force=requested)
            except Exception:  # never let the watcher die: the next look retries
                log.exception("checking the tokens file failed", extra={"path": str(self.path)})

    def start(self) -> TokensReloader:
        """Start the watching thread (a daemon); return self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokens-reload", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watching thread and wait for it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

