"""Where the agent's and the controller's pydantic settings are read from, in one place.

:class:`LayeredSettings` reads, first found wins: the arguments, then the
process's environment (or a given mapping in its place, for a snapshot or a
test), then a TOML file when one is named. A subclass names the mapping or the
file on a derived class, so two readers never share them:
``type(name, (Settings,), {"_environ": {...}})`` or ``{"_toml_file": path}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource


class GivenEnviron(PydanticBaseSettingsSource):
    """The variables of a given mapping instead of the process's environment (same names)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = str(field.validation_alias)
        return self.environ.get(name), name, False

    def __call__(self) -> dict[str, Any]:
        found = {}
        for field_name, field in self.settings_cls.model_fields.items():
            value, name, _ = self.get_field_value(field, field_name)
            if value not in (None, ""):  # empty is unset, as in the process's environment
                found[name] = value
        return found


class LayeredSettings(BaseSettings):
    """Settings from the arguments, the environment (or ``_environ``), then ``_toml_file``."""

    _environ: ClassVar[Mapping[str, str] | None] = None
    _toml_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(  # pydantic-settings' hook, in its signature
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environ = env_settings if cls._environ is None else GivenEnviron(settings_cls, cls._environ)
        sources: list[PydanticBaseSettingsSource] = [init_settings, environ]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)
