"""Fixtures for a real PostgreSQL: one pgserver per session, or SCHED_TEST_DATABASE_URL."""
