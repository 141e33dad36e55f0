"""GrammarCompiler over the embedded model's tokenizer: checks, the cache, fresh matchers, one-line errors."""

from __future__ import annotations

import llguidance
import pytest

from guidance.compiler import MAX_GRAMMAR_CHARS, GrammarCompiler, GrammarError

DIGITS = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{2,4}")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=1224, eos_token_ids=[2])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_grammar_is_compiled_once_and_every_matcher_is_a_fresh_copy(compiler, tokenizer):
    compiler.check(DIGITS)
    first, second = compiler.matcher(DIGITS), compiler.matcher(DIGITS)
    assert first is not second and compiler._compiled(DIGITS) is compiler._compiled(DIGITS)
    assert first.consume_tokens(ids(tokenizer, "12"))
    assert not second.is_accepting()  # the copies share no state


def test_a_matcher_is_advanced_over_the_tokens_generated_before(compiler, tokenizer):
    matcher = compiler.matcher(DIGITS, ids(tokenizer, "123"))
    assert matcher.is_accepting() and not matcher.is_error()


def test_a_grammar_that_does_not_compile_is_refused_with_one_line_and_the_refusal_is_cached(compiler):
    bad = llguidance.LLMatcher.grammar_from_lark("start: missing_rule")
    with pytest.raises(GrammarError) as first:
        compiler.check(bad)
    with pytest.raises(GrammarError) as again:
        compiler.check(bad)
    assert "missing_rule" in str(first.value) and "\n" not in str(first.value)
    assert str(again.value) == str(first.value) and bad in compiler._cache  # compiled once, refused twice


def test_replayed_tokens_outside_the_grammar_are_refused_without_the_parser_dump(compiler, tokenizer):
    with pytest.raises(GrammarError) as refused:
        compiler.matcher(DIGITS, ids(tokenizer, "1a"))
    message = str(refused.value)
    assert message.startswith("the tokens generated so far do not follow the grammar")
    assert "<state>" not in message and "\n" not in message and len(message) < 500


def test_a_replayed_token_outside_the_vocabulary_is_refused(compiler):
    with pytest.raises(GrammarError, match="out of range"):
        compiler.matcher(DIGITS, [5000])


def test_grammar_text_beyond_the_limit_is_refused_before_llguidance_sees_it(compiler):
    with pytest.raises(GrammarError, match=f"at most {MAX_GRAMMAR_CHARS}"):
        compiler.check("start: " + "x" * MAX_GRAMMAR_CHARS)


def test_a_refused_grammar_raises_a_fresh_error_each_time_and_oversized_text_is_never_cached(compiler):
    errors = []
    for _ in range(3):
        with pytest.raises(GrammarError) as err:
            compiler.check("start: undefined_rule")
        errors.append(err.value)
    # One cached exception re-raised would chain every request's frames onto its traceback.
    assert errors[0] is not errors[1] is not errors[2]
    with pytest.raises(GrammarError, match="at most"):
        compiler.check("x" * 300_000)
    assert all(len(text) < 300_000 for text in compiler._cache)
