"""Fixtures for a real Prefect server (a session-scoped test harness)."""
