"""Guided-decoding fields every API may carry, mapped onto one llguidance grammar and checked to compile.

OpenAI `response_format`, BladeLLM's `guided_*` fields, vLLM's `structured_outputs`, chat's forced
`tool_choice` and TGI's `parameters.grammar` each become a `Constraint`: the field that set it and the
llguidance grammar text. `checked_grammar` compiles it off the event loop (a cached compile per
distinct text) before any worker is used; the workers mask every token with the same text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import llguidance
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, WithJsonSchema, field_validator,
                      model_validator)

from coordinator.errors import ApiError
from coordinator.requests.request import GuidedGrammar
from guidance.compiler import GrammarCompiler, GrammarError, one_line

# JSON whitespace when the request names none: any JSON whitespace, but at most this many characters
# in a row, so a weak model cannot spend its whole budget on blank lines inside an object.
DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"
MAX_CHOICES = 1024

def _schema_value(value: Any) -> dict | str:
    if not isinstance(value, (dict, str)):
        raise ValueError("must be a JSON schema: an object, or its JSON text")
    return value


# A JSON schema, as an object or as its JSON text (one rule, so an error names the field, not a union member).
Schema = Annotated[Any, AfterValidator(_schema_value),
                   WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}]})]


def _non_empty(choices: list[str]) -> list[str]:
    if any(c == "" for c in choices):
        raise ValueError("every choice must have at least 1 character")
    return choices


Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES), AfterValidator(_non_empty)]


@dataclass(frozen=True)
class Constraint:
    """What the output must follow: the request field that asked for it, and llguidance's grammar text."""

    field: str
    grammar: str


def _schema_object(schema: Schema, field: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON schema object")
    return schema


def json_grammar(schema: Schema, field: str, whitespace: str | None = None) -> str:
    """llguidance grammar text for JSON following `schema`."""
    options = {"whitespace_pattern": DEFAULT_JSON_WHITESPACE if whitespace is None else whitespace}
    return llguidance.LLMatcher.grammar_from_json_schema(_schema_object(schema, field), overrides=options)


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str]) -> str:
    # JSON string literals are Lark string literals, escapes included.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def tool_call_lark(tools: dict[str, dict | None], repeat: bool) -> str:
    """Lark for tool calls in the chat template's form, `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
    whose arguments follow each tool's `parameters` schema; one call, or (`repeat`) one or more."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}}}
             for name, parameters in tools.items()]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}),
              "x-guidance": {"whitespace_pattern": DEFAULT_JSON_WHITESPACE}}
    return f"start: call{'+' if repeat else ''}\ncall: \"<tool_call>\" %json {json.dumps(schema)} \"</tool_call>\"\n"


class JsonSchemaFormat(BaseModel):
    """OpenAI `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: text, JSON mode, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type \"json_schema\" and allowed only with it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: Schema | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


def _one(found: list[tuple[str, Any]]) -> tuple[str, Any] | None:
    """The one constraint set, or a 400 naming the two that compete."""
    if len(found) > 1:
        raise ValueError(f"{found[0][0]} and {found[1][0]} both constrain the output; send only one of them")
    return found[0] if found else None


def _build(field: str, kind: str, value: Any, whitespace: str | None, whitespace_field: str) -> Constraint:
    if whitespace is not None and kind not in ("json", "json_object"):
        raise ValueError(f"{whitespace_field} applies only to a JSON constraint, not to {field}")
    if whitespace:  # checked on its own, so a bad pattern is named as itself, not as the schema's fault
        error = llguidance.LLMatcher.validate_grammar(regex_grammar(whitespace))
        if error:
            raise ValueError(f"{whitespace_field}: {one_line(error)}")
    if kind == "json":
        return Constraint(field, json_grammar(value, field, whitespace))
    if kind == "json_object":
        return Constraint(field, json_grammar({"type": "object"}, field, whitespace))
    if kind == "regex":
        return Constraint(field, regex_grammar(value))
    if kind == "choice":
        return Constraint(field, choice_grammar(value))
    return Constraint(field, lark_grammar(value))


class GuidedFields(BaseModel):
    """The guided-decoding fields of OpenAI chat and completions (BladeLLM, OpenAI, vLLM; docs/compatibility.md)."""

    response_format: ResponseFormat | None = None
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None  # Lark, as llguidance reads it
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    _constraint: Constraint | None = PrivateAttr(None)

    @field_validator("response_format", mode="before")
    @classmethod
    def _bare_type(cls, value: Any) -> Any:
        # BladeLLM sends the type alone ("json_object"); one model then validates both forms.
        return {"type": value} if isinstance(value, str) else value

    def _requested(self) -> list[tuple[str, str, Any]]:
        """(field, kind, value) for every constraint the body sets."""
        found = []
        rf = self.response_format
        kind = rf.type if rf else "text"
        if kind == "json_object":
            found.append(("response_format", "json_object", None))
        elif kind == "json_schema":
            found.append(("response_format.json_schema.schema", "json", rf.json_schema.schema_))
        for name, k in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, k, getattr(self, name)))
        so = self.structured_outputs
        if so is not None:
            for name, k in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
                if getattr(so, name) is not None:
                    found.append((f"structured_outputs.{name.rstrip('_')}", k, getattr(so, name)))
            if so.json_object:
                found.append(("structured_outputs.json_object", "json_object", None))
        return found

    def extra_constraints(self) -> list[tuple[str, str, Any]]:
        """Constraints an API adds beyond these fields (chat's forced tool calls)."""
        return []

    @model_validator(mode="after")
    def _at_most_one_constraint(self):
        one = _one([(f, (k, v)) for f, k, v in self._requested() + self.extra_constraints()])
        so = self.structured_outputs
        if so is not None and so.whitespace_pattern is not None and self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern and structured_outputs.whitespace_pattern both set "
                             "JSON whitespace; send only one of them")
        whitespace_field = "guided_whitespace_pattern" if self.guided_whitespace_pattern is not None \
            else "structured_outputs.whitespace_pattern"
        whitespace = self.guided_whitespace_pattern if self.guided_whitespace_pattern is not None \
            else (so.whitespace_pattern if so else None)
        if one is None:
            if whitespace is not None:
                raise ValueError(f"{whitespace_field} applies only to a JSON constraint, and none is set")
            self._constraint = None
            return self
        field, (kind, value) = one
        if getattr(self, "ignore_eos", False):
            raise ValueError(f"ignore_eos cannot be combined with {field}: the grammar decides where the output ends")
        self._constraint = _build(field, kind, value, whitespace, whitespace_field)
        return self

    def constraint(self) -> Constraint | None:
        return self._constraint


class TgiGrammar(BaseModel):
    """TGI's `parameters.grammar`: `{"type": "json", "value": schema}` or `{"type": "regex", "value": regex}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "regex"]
    value: Schema
    _constraint: Constraint = PrivateAttr()

    @model_validator(mode="after")
    def _value_fits_type(self):
        field = "parameters.grammar.value"
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise ValueError("a regex grammar's value must be a string")
            self._constraint = Constraint(field, regex_grammar(self.value))
        else:
            self._constraint = Constraint(field, json_grammar(self.value, field))
        return self

    def constraint(self) -> Constraint:
        return self._constraint


async def checked_grammar(compiler: GrammarCompiler | None, constraint: Constraint | None,
                          replay: Sequence[int] = (), replay_field: str = "") -> GuidedGrammar | None:
    """The constraint's grammar once it compiles (off the event loop), a 400 naming the field otherwise;
    `replay` (tokens already in the output, from `replay_field`) must follow it and is replayed first."""
    if constraint is None:
        return None
    if compiler is None:
        raise ApiError(400, f"{constraint.field}: guided decoding is not available for this model's tokenizer",
                       param=constraint.field)
    try:
        await asyncio.to_thread(compiler.check, constraint.grammar)
    except GrammarError as exc:
        raise ApiError(400, f"{constraint.field}: {exc}", param=constraint.field) from None
    if replay:
        try:
            await asyncio.to_thread(compiler.matcher, constraint.grammar, replay)
        except GrammarError:
            raise ApiError(400, f"{replay_field}: the text does not follow the grammar {constraint.field} asks for",
                           param=replay_field) from None
    return GuidedGrammar(constraint.grammar, tuple(replay))
