"""The settings tables of the docs, made from the settings models: the models are the source.

The flags of ``sched controller serve`` are made the same way from the command itself
(a row: the flag, its default, its help). ``python scripts/settings_docs.py`` rewrites each
table in place (run it after changing a
field); ``--check`` only says which differ (exit 1). tests/test_settings_docs.py fails
when a table in a doc is not what the model makes.

A row is ``| `field` | `ENV_NAME` | default | meaning |``: the meaning is the field's
``description``, the variable is its alias or the model's ``env_prefix`` and its name in
capitals, the default is written from the field's default (seconds for a duration,
``none`` for None or empty, ``required`` without one). A field whose variable or default
needs words says them in ``json_schema_extra``: ``docs_env``, ``docs_default``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the checkout's packages

from controller.settings import ControllerSettings  # noqa: E402
from sched_node.settings import AgentSettings  # noqa: E402

FLAG_HEADER = "| flag | default | meaning |"
FLAG_SEPARATOR = "|---|---|---|"

HEADER = "| setting | env | default | meaning |"
SEPARATOR = "|---|---|---|---|"
TABLES: dict[str, type[BaseModel]] = {
    "docs/agent-reference.md": AgentSettings,
    "docs/controller.md": ControllerSettings,
}
"""Each doc with a settings table (its one line ``HEADER``), and the model it is made from."""
REGENERATE = "python scripts/settings_docs.py"


def _extra(field: FieldInfo, key: str) -> str | None:
    extra = field.json_schema_extra
    value = extra.get(key) if isinstance(extra, dict) else None
    return None if value is None else str(value)


def env_cell(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    """Return the env column: the field's variable (its alias, or the prefix and its name)."""
    said = _extra(field, "docs_env")
    if said is not None:
        return said
    if isinstance(field.validation_alias, str):
        return f"`{field.validation_alias}`"
    prefix = str(model.model_config.get("env_prefix") or "")
    return f"`{prefix}{name.upper()}`"


def default_text(value: Any) -> str:
    """Return how the table writes a default value."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None or value in ("", {}, []):
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def default_cell(field: FieldInfo) -> str:
    """Return the default column: the field's default (made, for a factory), or its words."""
    said = _extra(field, "docs_default")
    if said is not None:
        return said
    if field.default_factory is not None:
        return default_text(field.default_factory())  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return "required"
    return default_text(field.default)


def rows(model: type[BaseModel]) -> list[str]:
    """Return the table a model makes: header, separator, one row per field in its order."""
    made = [HEADER, SEPARATOR]
    for name, field in model.model_fields.items():
        if not field.description:
            raise ValueError(f"{model.__name__}.{name} has no description for the docs")
        made.append(f"| `{name}` | {env_cell(model, name, field)} | {default_cell(field)} | "
                     f"{field.description} |")
    return made


def flag_rows() -> list[str]:
    """Return the table of ``sched controller serve``'s flags, from the command itself."""
    import typer.main

    from controller.cli import app

    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    made = [FLAG_HEADER, FLAG_SEPARATOR]
    for param in command.params:
        if param.param_type_name != "option" or param.name == "help":
            continue
        flag = ", ".join(f"`{name}`" for name in param.opts)
        if param.is_flag:
            default = "off" if not param.default else "on"
        else:
            default = default_text(param.default)
        made.append(f"| {flag} | {default} | {param.help} |")
    return made


FLAG_TABLES = {"docs/controller.md": flag_rows}
"""Each doc with a flags table (its one line ``FLAG_HEADER``), and what makes it."""


def table_lines(text: str, header: str = HEADER) -> tuple[int, int]:
    """Return where a doc's table is: (first line, line after the last) of text."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    if len(starts) != 1:
        raise ValueError(f"expected one line {header!r}, found {len(starts)}")
    end = starts[0] + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return starts[0], end


def documented(text: str, header: str = HEADER) -> list[str]:
    """Return the table of a doc's text that opens with header, line by line."""
    start, end = table_lines(text, header)
    return text.splitlines()[start:end]


def replace_table(text: str, made: list[str]) -> str:
    """Return text with the table that opens like made replaced by made."""
    start, end = table_lines(text, made[0])
    lines = text.splitlines()
    lines[start:end] = made
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def rewrite(text: str, model: type[BaseModel]) -> str:
    """Return text with its settings table replaced by the one the model makes."""
    return replace_table(text, rows(model))


def first_difference(doc: list[str], made: list[str]) -> str | None:
    """Return the first line where a documented table and a made one differ, said, or None."""
    for number, (found, wanted) in enumerate(zip(doc, made, strict=False), start=1):
        if found != wanted:
            return f"line {number} of the table:\n  the doc:   {found}\n  the model: {wanted}"
    if len(doc) > len(made):
        return f"line {len(made) + 1} of the table is only in the doc: {doc[len(made)]}"
    if len(made) > len(doc):
        return f"line {len(doc) + 1} of the table is only in the model: {made[len(doc)]}"
    return None


def tables() -> list[tuple[str, str, list[str], str]]:
    """Return each generated table: its doc, its header, the table made, and what made it."""
    made = [(doc, HEADER, rows(model), model.__name__) for doc, model in TABLES.items()]
    made += [(doc, FLAG_HEADER, make(), "the command") for doc, make in FLAG_TABLES.items()]
    return made


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = 0
    for doc, header, made, source in tables():
        path = ROOT / doc
        text = path.read_text(encoding="utf-8")
        new = replace_table(text, made)
        if new == text:
            continue
        stale += 1
        if check:
            print(f"{doc}: a table differs from {source}, "
                  f"{first_difference(documented(text, header), made)}")
        else:
            path.write_text(new, encoding="utf-8")
            print(f"{doc}: table rewritten from {source}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
