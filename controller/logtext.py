"""Text from outside made safe for one log line, and URLs without their passwords.

Rule: a value a client chose (a node name, a schedule id, a task name, a path)
reaches a log line only through :func:`printable`, so it can neither start a
forged line (a newline) nor drive the terminal that shows the log (an escape
sequence such as ``\\x1b[2J``). The command line's formatter applies it to
every line as well (:class:`controller.cli.ContextFormatter`).

Rule: a URL's credentials (``https://user:password@host``, as
``PREFECT_API_URL`` or ``SCHED_DATABASE_URL`` may hold them) never reach a log
line: the command line's formatter passes every line through
:func:`redact_credentials`.
"""

from __future__ import annotations

import re

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """Return text with every non-printable character escaped (``\\x1b``, ``\\n``, ``\\u202e``).

    Printable characters, ASCII or not, are kept as they are. With
    ``keep_newlines`` a newline stays (a traceback's lines).
    """
    if text.isprintable():
        return text
    out = []
    for char in text:
        if char.isprintable() or (keep_newlines and char == "\n"):
            out.append(char)
        else:
            out.append(_escape(char))
    return "".join(out)


_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#@]*@")
"""A URL's userinfo (``user:password@``, ``token@``), up to its last ``@`` before the host."""


def redact_credentials(text: str) -> str:
    """Return text with every URL's ``user:password@`` replaced by ``***@``."""
    if "@" not in text:
        return text
    return _CREDENTIALS.sub(r"\1***@", text)
