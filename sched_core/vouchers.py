"""Vouchers: the controller's word that an ad hoc run or a cancel of a node's job is wanted.

Rule: a node set to take runs only when its controller vouches for them
(``ad_hoc_runs = "controller"``) takes a run of its job, a chain run, the UI's Retry or a
cancel only with a voucher the controller issued for exactly that: the node, the purpose
(``run``: a schedule's job now, ``chain``: an ad hoc chain, ``cancel``: a flow run's job),
the subject (the schedule id, the node, the flow run id), a time it expires and a nonce
the node takes once. Its signature is an HMAC-SHA256 keyed by the SHA-256 digest of the
node's controller token: the controller holds only digests, the node its token, and
nobody else either. A voucher with one signature per token of the node works with any.

Pure: no I/O; ``now`` is a parameter.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from sched_core.errors import SchedError

PURPOSES = frozenset({"run", "chain", "cancel"})
VERSION = "v1"
MAX_LENGTH = 2000
"""The longest voucher read (a few signatures)."""


class VoucherRefused(SchedError, ValueError):
    """A voucher that does not vouch for this: its text says why."""


@dataclass(frozen=True)
class Voucher:
    """What a voucher that verified says."""

    node: str
    purpose: str
    subject: str
    expires_at: datetime
    nonce: str


def token_key(token: str) -> bytes:
    """Return the key a token signs with: its SHA-256 digest (what the controller holds)."""
    return hashlib.sha256(token.strip().encode()).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _sign(key: bytes, payload: str) -> str:
    return _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())


def issue(keys: list[bytes], *, node: str, purpose: str, subject: str, expires_at: datetime,
          nonce: str) -> str:
    """Return a voucher for purpose on subject at node, signed with each key."""
    if purpose not in PURPOSES:
        raise ValueError(f"no voucher purpose {purpose!r} (one of {', '.join(sorted(PURPOSES))})")
    if not keys:
        raise ValueError(f"node {node!r} has no token to sign a voucher with")
    payload = _b64(json.dumps({"n": node, "p": purpose, "s": subject,
                               "e": int(expires_at.timestamp()), "r": nonce},
                              separators=(",", ":")).encode())
    return ".".join([VERSION, payload, *(_sign(key, payload) for key in keys)])


def verify(text: object, key: bytes, *, node: str, purpose: str, subject: str,
           now: datetime) -> Voucher:
    """Return the voucher text is, when it vouches for purpose on subject at node now;
    else raise VoucherRefused saying why."""
    if not isinstance(text, str) or not text:
        raise VoucherRefused("no voucher from the controller")
    if len(text) > MAX_LENGTH:
        raise VoucherRefused("the voucher is too long")
    parts = text.split(".")
    if len(parts) < 3 or parts[0] != VERSION:
        raise VoucherRefused("the voucher is not one the controller issues")
    payload, signatures = parts[1], parts[2:]
    mine = _sign(key, payload)
    if not any(hmac.compare_digest(mine, signature) for signature in signatures):
        raise VoucherRefused("the voucher's signature is not the controller's for this node")
    try:
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        found = Voucher(node=str(data["n"]), purpose=str(data["p"]), subject=str(data["s"]),
                        expires_at=datetime.fromtimestamp(int(data["e"]), UTC),
                        nonce=str(data["r"]))
    except (ValueError, KeyError, TypeError, OverflowError):
        raise VoucherRefused("the voucher is malformed") from None
    if found.node != node:
        raise VoucherRefused(f"the voucher is for node {found.node!r}")
    if (found.purpose, found.subject) != (purpose, subject):
        raise VoucherRefused(f"the voucher is for {found.purpose} {found.subject!r}, "
                             f"not {purpose} {subject!r}")
    if found.expires_at <= now:
        raise VoucherRefused(f"the voucher expired at {found.expires_at.isoformat()}")
    return found
