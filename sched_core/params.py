"""The Go kit's parameter coercions, faithful to JSON types.

JSON has one number type; Go decodes it as float64. Python keeps ints and
floats apart and treats ``bool`` as an ``int`` subclass, so each helper checks
``bool`` first: a JSON ``true`` is never a number here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def param_string(params: Mapping[str, Any] | None, key: str) -> str:
    """Return params[key] if it is a string, else ""."""
    value = (params or {}).get(key)
    return value if isinstance(value, str) else ""


def param_int(params: Mapping[str, Any] | None, key: str) -> int:
    """Return params[key] as an int, truncating a float toward zero; 0 on miss or wrong type."""
    value = (params or {}).get(key)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return 0


def param_bool(params: Mapping[str, Any] | None, key: str) -> bool:
    """Return params[key] if it is a bool, else False."""
    value = (params or {}).get(key)
    return value if isinstance(value, bool) else False


def param_strings(params: Mapping[str, Any] | None, key: str) -> list[str]:
    """Return the string elements of the list params[key]; [] on miss or wrong type."""
    value = (params or {}).get(key)
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, str)]
