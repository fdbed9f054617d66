"""docs/controller.md's endpoint table is the API's reference: exactly what the app serves.

Checked against the OpenAPI document the controller serves, so a new route or a
removed one fails here until the table says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import create_engine

from controller.api import create_app
from controller.auth import Tokens

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "controller.md").read_text(encoding="utf-8")


def _shape(path: str) -> str:
    """The path without its query and with every placeholder alike: /api/x/{}/y."""
    return re.sub(r"\{[^}]*\}", "{}", path.split("?", 1)[0])


def listed_endpoints() -> set[tuple[str, str]]:
    section = PAGE.split("\n### Endpoints\n", 1)[1].split("\n#", 1)[0]
    found: set[tuple[str, str]] = set()
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"[A-Z /]+", cells[0]) or cells[0] == "method":
            continue
        path = cells[1].strip("`")
        found |= {(method.strip(), _shape(path)) for method in cells[0].split("/")}
    return found


def served_endpoints() -> set[tuple[str, str]]:
    app = create_app(create_engine("sqlite://"), Tokens(admin=["a" * 40]))
    return {(method.upper(), _shape(path))
            for path, operations in app.openapi()["paths"].items() for method in operations}


def test_the_docs_list_every_endpoint_the_controller_serves_and_no_other() -> None:
    listed, served = listed_endpoints(), served_endpoints()
    assert len(served) >= 20, served
    assert served - listed == set(), "served but not in the table"
    assert listed - served == set(), "in the table but not served"
