"""The scaled layout's settings (scripts/scaled.py), without starting anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "scaled.py"


def _load_scaled() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scaled_layout_config", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


scaled = _load_scaled()


def test_the_controllers_connection_ceiling_is_a_setting() -> None:
    # A node's long poll holds a connection: 10,000 nodes need more than serve's 1,000.
    assert scaled.config_from_env({})["controller_max_connections"] == 1000
    config = scaled.config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": "12000"})
    assert config["controller_max_connections"] == 12000
    for bad in ("0", "many"):
        with pytest.raises(scaled.LayoutError, match="SCALED_CONTROLLER_MAX_CONNECTIONS"):
            scaled.config_from_env({"SCALED_CONTROLLER_MAX_CONNECTIONS": bad})
