"""Shared fixtures live in plugin modules, one per real component."""

pytest_plugins = ["tests.fixtures_pg", "tests.fixtures_prefect"]
