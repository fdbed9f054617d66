"""The scaled layout's settings (scripts/scaled.py), without starting anything."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

scaled = load_script("scripts/scaled.py", "scaled_layout")


def test_the_controllers_connection_ceiling_is_a_setting() -> None:
    # A node's long poll holds a connection: 10,000 nodes need more than serve's 1,000.
    assert scaled.config_from_env({})["controller_max_connections"] == 1000
    config = scaled.config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": "12000"})
    assert config["controller_max_connections"] == 12000
    for bad in ("0", "many"):
        with pytest.raises(scaled.LayoutError, match="SCALED_CONTROLLER_MAX_CONNECTIONS"):
            scaled.config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": bad})
