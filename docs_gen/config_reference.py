"""The ms_coordinator.json reference: every key of the config models with its type, default, range and meaning."""

from __future__ import annotations

import inspect
import json
import types
import typing

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from coordinator.config import CoordinatorConfig
from docs_gen.markdown import banner, cell, code, table

INTRO = """# ms_coordinator.json

The coordinator reads this file once at start-up (`pdserve coordinator --config FILE`); command-line flags
override `predict_ip` and `predict_port`. An unknown key, a wrong type or a value out of range stops start-up
with a message naming it (`ms_coordinator.json: http_config.predict_prot: unknown key`). File paths (certificates,
keys, secrets, the API key file) are relative to the config file's folder. A worker reads `tls_config` and
`auth_config` from its `--security-config` file. Every key may be left out; the default applies.
"""


def field_key(name: str, field: FieldInfo) -> str:
    return field.alias or name


def nested_model(annotation: object) -> type[BaseModel] | None:
    """The model a field holds, alone or as list items; None for a plain value."""
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return annotation if inspect.isclass(annotation) and issubclass(annotation, BaseModel) else None


def type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(code(v) for v in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        model = nested_model(annotation)
        return "list of objects" if model else f"list of {type_name(item)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "object"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


def value_range(field: FieldInfo) -> str:
    low = high = ""
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge):
            low = f"[{rule.ge}"
        elif isinstance(rule, annotated_types.Gt):
            low = f"({rule.gt}"
        elif isinstance(rule, annotated_types.Le):
            high = f"{rule.le}]"
        elif isinstance(rule, annotated_types.Lt):
            high = f"{rule.lt})"
    if not low and not high:
        return ""
    return f"{low or '(-inf'}, {high or 'inf)'}"


def default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, BaseModel):
        return ""
    return code(field.default)


def model_rows(model: type[BaseModel], prefix: str) -> list[list[str]]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field_key(name, field)}"
        inner = nested_model(field.annotation)
        if inner is not None and typing.get_origin(field.annotation) is not list:
            rows.append([f"`{key}`", "object", "", "", cell(field.description or first_line(inner))])
            continue
        rows.append([f"`{key}`", type_name(field.annotation), default(field), value_range(field),
                     cell(field.description or "")])
    return rows


def first_line(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())


def sections(config: type[BaseModel] = CoordinatorConfig):
    """(heading, row prefix, model) for each section of the file, each followed by the object models it holds
    (a model held under several keys, such as one TLS link, once for all of them)."""
    for name, field in config.model_fields.items():
        model = nested_model(field.annotation)
        key = field_key(name, field)
        yield key, f"{key}.", model
        held: dict[type[BaseModel], list[str]] = {}
        for inner_name, inner in model.model_fields.items():
            inner_model = nested_model(inner.annotation)
            if inner_model is not None:
                many = "[]" if typing.get_origin(inner.annotation) is list else ""
                held.setdefault(inner_model, []).append(field_key(inner_name, inner) + many)
        for inner_model, keys in held.items():
            if len(keys) == 1:
                yield f"{key}.{keys[0]}", f"{key}.{keys[0]}.", inner_model
            else:
                yield f"{key}.{{{', '.join(keys)}}}", "", inner_model


def render() -> str:
    parts = [banner("coordinator/config.py and security/settings.py"), INTRO]
    for heading, prefix, model in sections():
        parts.append(f"## `{heading}`\n\n{cell(' '.join((model.__doc__ or '').split()))}\n")
        parts.append(table(["key", "type", "default", "range", "meaning"], model_rows(model, prefix)))
    defaults = json.dumps(CoordinatorConfig().model_dump(by_alias=True), indent=2)
    parts.append(f"## Every default, as a file\n\n```json\n{defaults}\n```\n")
    return "\n".join(parts)
