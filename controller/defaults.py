"""Defaults of the central scheduler, importable without its dependencies (for the CLI's help)."""

from __future__ import annotations

DEFAULT_MAX_ATTEMPTS = 20
"""Dispatch attempts per (task, scheduled time) before giving up: about 2.5 hours of
retries with the default backoff (10 s doubling, capped at 10 minutes)."""

DEFAULT_DISPATCH_RETENTION = 30 * 86400.0
"""Seconds a finished dispatch record is kept (30 days)."""
