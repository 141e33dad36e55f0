"""Guided-decoding fields map onto one llguidance grammar; conflicts and bad grammars are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator.apis.fields import parse_request
from coordinator.apis.guided import TgiGrammar, checked_grammar, tool_call_lark
from coordinator.apis.openai_chat import ChatCompletionRequest
from coordinator.apis.openai_completions import CompletionRequest
from coordinator.apis.tgi import TgiRequest
from coordinator.errors import ApiError
from guidance.compiler import GrammarCompiler

COMPLETION = {"model": "m", "prompt": "Hi"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def compiler(model_dir):
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(model_dir))


def _accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    matcher = compiler.matcher(grammar)
    ids = compiler.tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def _constraint(model, body):
    return parse_request(model, body).constraint()


@pytest.mark.parametrize("extra,field", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),  # BladeLLM sends the bare type (docs/compatibility.md)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_json": "{\"type\": \"object\"}"}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"guided_grammar": "start: \"a\"+"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object"),
])
def test_each_guided_field_becomes_a_constraint_named_after_it(extra, field):
    assert _constraint(CompletionRequest, {**COMPLETION, **extra}).field == field


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"response_format": "text"}])
def test_text_response_format_constrains_nothing(extra):
    assert _constraint(CompletionRequest, {**COMPLETION, **extra}) is None


@pytest.mark.parametrize("extra,names", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, ("guided_regex", "guided_choice")),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, ("response_format", "guided_json")),
    ({"guided_grammar": "start: \"a\"", "structured_outputs": {"choice": ["a"]}},
     ("guided_grammar", "structured_outputs.choice")),
])
def test_two_constraints_are_a_400_naming_both(extra, names):
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {**COMPLETION, **extra})
    assert err.value.status == 400 and all(n in err.value.message for n in names)


@pytest.mark.parametrize("extra,needle", [
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern applies only to a JSON constraint"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "not to guided_regex"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json must be a JSON schema object"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "at least 1 character"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined with guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag: unknown field"),
])
def test_bad_guided_fields_are_400(extra, needle):
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {**COMPLETION, **extra})
    assert err.value.status == 400 and needle in err.value.message


@pytest.mark.parametrize("field,value,needle", [
    ("guided_regex", "[a-", "unclosed character class"),
    ("guided_grammar", "start: undefined_rule", "unknown name"),
    ("guided_json", {"type": "strnig"}, "strnig"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(compiler, field, value, needle):
    constraint = _constraint(CompletionRequest, {**COMPLETION, field: value})
    with pytest.raises(ApiError) as err:
        asyncio.run(checked_grammar(compiler, constraint))
    assert err.value.status == 400 and err.value.param == field
    assert err.value.message.startswith(f"{field}: ") and needle in err.value.message


def test_a_grammar_too_large_is_a_400(compiler):
    constraint = _constraint(CompletionRequest, {**COMPLETION, "guided_regex": "a" * 300_000})
    with pytest.raises(ApiError) as err:
        asyncio.run(checked_grammar(compiler, constraint))
    assert "at most 262144" in err.value.message


def test_grammars_compile_once_per_distinct_text(compiler):
    grammar = _constraint(CompletionRequest, {**COMPLETION, "guided_regex": "x[0-9]{3}"}).grammar
    compiler.check(grammar)
    assert compiler._compiled(grammar) is compiler._compiled(grammar)
    assert compiler.matcher(grammar) is not compiler.matcher(grammar)  # each request its own matcher


def test_choice_grammar_accepts_exactly_the_choices(compiler):
    choices = ["yes", "no \"quoted\"", "back\\slash", "üñí"]
    grammar = _constraint(CompletionRequest, {**COMPLETION, "guided_choice": choices}).grammar
    assert all(_accepts(compiler, grammar, c) for c in choices)
    assert not _accepts(compiler, grammar, "maybe")


def test_json_whitespace_is_bounded_by_default_and_settable(compiler):
    default = _constraint(CompletionRequest, {**COMPLETION, "guided_json": {"type": "object"}}).grammar
    assert _accepts(compiler, default, '{"a": 1}')
    assert not _accepts(compiler, default, '{"a":' + " " * 40 + "1}")
    tight = _constraint(CompletionRequest, {**COMPLETION, "guided_json": {"type": "object"},
                                            "guided_whitespace_pattern": ""}).grammar
    assert _accepts(compiler, tight, '{"a":1}') and not _accepts(compiler, tight, '{"a": 1}')


@pytest.mark.parametrize("tool_choice,good,bad", [
    ("required",
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ({"type": "function", "function": {"name": "get_weather"}},
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
])
def test_forced_tool_choice_allows_only_valid_calls(compiler, tool_choice, good, bad):
    constraint = _constraint(ChatCompletionRequest, {**CHAT, "tool_choice": tool_choice})
    assert constraint.field == "tool_choice"
    assert _accepts(compiler, constraint.grammar, good) and not _accepts(compiler, constraint.grammar, bad)


def test_a_named_tool_call_is_exactly_one_call(compiler):
    grammar = tool_call_lark({"f": None}, repeat=False)
    from coordinator.apis.guided import lark_grammar

    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _accepts(compiler, lark_grammar(grammar), call)
    assert not _accepts(compiler, lark_grammar(grammar), call + call)


@pytest.mark.parametrize("tool_choice,constrained", [("auto", False), ("none", False), ("required", True)])
def test_only_forced_tool_choices_constrain(tool_choice, constrained):
    assert (_constraint(ChatCompletionRequest, {**CHAT, "tool_choice": tool_choice}) is not None) == constrained


def test_tool_choice_and_another_constraint_are_a_400():
    with pytest.raises(ApiError) as err:
        parse_request(ChatCompletionRequest, {**CHAT, "tool_choice": "required", "guided_regex": "a"})
    assert "guided_regex and tool_choice" in err.value.message


@pytest.mark.parametrize("grammar,field_kind", [
    ({"type": "json", "value": {"type": "object"}}, "json"),
    ({"type": "json", "value": json.dumps({"type": "object"})}, "json"),
    ({"type": "regex", "value": "[0-9]+"}, "regex"),
])
def test_tgi_grammar_becomes_a_constraint(compiler, grammar, field_kind):
    request = parse_request(TgiRequest, {"inputs": "Hi", "parameters": {"grammar": grammar}})
    constraint = request.parameters.grammar.constraint()
    assert constraint.field == "parameters.grammar.value"
    asyncio.run(checked_grammar(compiler, constraint))


@pytest.mark.parametrize("grammar,needle", [
    ({"type": "lark", "value": "x"}, "parameters.grammar.type"),
    ({"type": "regex", "value": {"a": 1}}, "a regex grammar's value must be a string"),
    ({"type": "json", "value": ""}, "parameters.grammar.value is not valid JSON"),
    ({"type": "json", "value": [1]}, "parameters.grammar.value"),
])
def test_bad_tgi_grammar_is_400(grammar, needle):
    with pytest.raises(ApiError) as err:
        parse_request(TgiRequest, {"inputs": "Hi", "parameters": {"grammar": grammar}})
    assert needle in err.value.message


def test_tgi_grammar_model_validates_its_own_value():
    assert TgiGrammar(type="regex", value="a+").constraint().field == "parameters.grammar.value"


@pytest.mark.parametrize("extra,param,needle", [
    ({"response_format": {"type": "bogus"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"response_format": "bogus"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "at least 1 character"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "("}, None,
     "guided_whitespace_pattern: at 1(8): invalid regex"),
])
def test_guided_field_errors_name_the_field_itself(extra, param, needle):
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {**COMPLETION, **extra})
    assert err.value.param == param and needle in err.value.message


def test_replayed_text_that_follows_the_grammar_is_carried_as_generated_tokens(compiler):
    constraint = _constraint(CompletionRequest, {**COMPLETION, "guided_json": {"type": "object"}})
    partial = compiler.tokenizer.tokenize_str('{"name": "Al')
    guided = asyncio.run(checked_grammar(compiler, constraint, partial, "resume_response"))
    assert guided.generated == tuple(partial)
    with pytest.raises(ApiError) as err:
        asyncio.run(checked_grammar(compiler, constraint, compiler.tokenizer.tokenize_str("Hello"), "resume_response"))
    assert err.value.param == "resume_response" and "does not follow the grammar guided_json" in err.value.message


def test_without_a_grammar_compiler_a_constraint_is_a_400_not_a_crash():
    constraint = _constraint(CompletionRequest, {**COMPLETION, "guided_regex": "a+"})
    with pytest.raises(ApiError) as err:
        asyncio.run(checked_grammar(None, constraint))
    assert err.value.status == 400 and "not available for this model's tokenizer" in err.value.message
