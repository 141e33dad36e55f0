"""Every key of ms_coordinator.json has a meaning for the generated reference to show."""

from __future__ import annotations

from pydantic import BaseModel

from coordinator.config import CoordinatorConfig
from docs_gen.config_reference import nested_model, render, sections


def leaf_keys(model: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    keys = {}
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        inner = nested_model(field.annotation)
        if inner is None:
            keys[key] = field.description
        else:
            keys.update(leaf_keys(inner, key + "."))
    return keys


def test_every_config_key_has_a_description():
    missing = [key for key, description in leaf_keys(CoordinatorConfig).items() if not description]
    assert missing == [], "add Field(description=...) to these keys"


def test_every_section_has_a_docstring():
    assert [heading for heading, _, model in sections() if not model.__doc__] == []


def test_the_reference_names_every_key_and_section():
    page = render()
    for key in leaf_keys(CoordinatorConfig):
        section, _, name = key.rpartition(".")
        assert f"`{key}`" in page or f"`{name}`" in page, key
    for heading, _, _ in sections():
        assert f"## `{heading}`" in page
