"""The settings tables of docs/agent-reference.md and docs/controller.md are the settings models'.

Each table is made from its model (``scripts/settings_docs.py``: a field's description,
its variable, its default), so a new field, a renamed variable, a changed default or
meaning fails here until the doc is made again: ``python scripts/settings_docs.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


DOCS = load_script("scripts/settings_docs.py", "settings_docs")


@pytest.mark.parametrize("doc", sorted(DOCS.TABLES))
def test_the_settings_table_is_the_one_the_model_makes(doc: str) -> None:
    model = DOCS.TABLES[doc]
    documented = DOCS.documented((ROOT / doc).read_text(encoding="utf-8"))
    made = DOCS.rows(model)
    difference = DOCS.first_difference(documented, made)
    assert difference is None, (
        f"{doc}'s settings table is not {model.__name__}'s: {difference}\n"
        f"change the field's description (or its docs_env/docs_default), then run "
        f"`{DOCS.REGENERATE}` to rewrite the table")


def test_every_field_is_in_the_table_with_its_variable_and_default() -> None:
    class Example(BaseModel):
        model_config = {"env_prefix": "X_"}  # type: ignore[typeddict-unknown-key]

        plain: int = Field(3, description="a number")
        named: str = Field("", validation_alias="OTHER", description="text")
        worded: list[str] = Field(default_factory=list, json_schema_extra={
            "docs_env": "(TOML)", "docs_default": "all"}, description="a list")
        needed: bool = Field(description="a flag")

    assert DOCS.rows(Example)[2:] == [
        "| `plain` | `X_PLAIN` | 3 | a number |",
        "| `named` | `OTHER` | none | text |",
        "| `worded` | (TOML) | all | a list |",
        "| `needed` | `X_NEEDED` | required | a flag |",
    ]
    made = DOCS.rows(Example)
    assert DOCS.first_difference(made[:3] + made[4:], made) == (
        "line 4 of the table:\n  the doc:   " + made[4] + "\n  the model: " + made[3])


@pytest.mark.parametrize("doc", sorted(DOCS.FLAG_TABLES))
def test_the_flags_table_is_the_one_the_command_makes(doc: str) -> None:
    documented = DOCS.documented((ROOT / doc).read_text(encoding="utf-8"), DOCS.FLAG_HEADER)
    made = DOCS.FLAG_TABLES[doc]()
    difference = DOCS.first_difference(documented, made)
    assert difference is None, (
        f"{doc}'s flags table is not `sched controller serve`'s: {difference}\n"
        f"change the option's help, then run `{DOCS.REGENERATE}` to rewrite the table")
    assert any(row.startswith("| `--max-connections` | 4000 |") for row in made)
