"""PretokenCache gives exactly the ids the Rust tokenizer gives, or None: on the embedded model's byte-level BPE and
on a Llama-3-style one (a Split regex, then ByteLevel), over text built to find the split's edges (contractions,
whitespace runs before words, digits, punctuation, chat markers), and stands aside where it cannot be sure."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import AddedToken

from coordinator.requests.pretoken_cache import PretokenCache
from coordinator.requests.tokenization import PromptTokenizer

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
ALPHABET = ["hello", "world", "The", "it's", "we'll", "I'M", "x", "42", "2024", "1234567", "3.14", "!", "?!",
            "...", "--", "(", ")", "{\"k\": 1}", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "_", "a_b",
            "<|im_start|>", "<|im_end|>", "user", "'", "''s", "don't", "O'Neil", "#", "@x", "ab12cd", "  \t x"]


def texts(seed: int, count: int = 300) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def llama3_style(tmp_path: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    corpus = texts(1, 200) + ["the quick brown fox jumps over the lazy dog 0123456789"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=
                                                              pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tokenizer


def test_the_embedded_models_ids_equal_rusts_with_and_without_specials(model_dir):
    rust = PromptTokenizer(model_dir).tokenizer.backend_tokenizer
    cache = PretokenCache(rust)
    assert cache.usable
    for text in texts(7):
        for specials in (True, False):
            assert cache.encode(text, specials) == rust.encode(text, add_special_tokens=specials).ids, repr(text)


def test_a_split_regex_then_byte_level_tokenizer_gives_rusts_ids(tmp_path):
    rust = llama3_style(tmp_path)
    cache = PretokenCache(rust)
    assert cache.usable
    for text in texts(11):
        assert cache.encode(text) == rust.encode(text).ids, repr(text)


def test_a_chat_prompt_with_its_markers_is_rusts_ids_and_the_tokenizer_uses_them(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    messages = [{"role": "system", "content": "Be brief, it's late."}, {"role": "user", "content": "Hi  there\n\n42"}]
    prompt = tokenizer.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer._pretokens.encode(prompt, add_special_tokens=False) == expected
    assert tokenizer.encode_now(prompt, add_special_tokens=False) == expected


def test_text_it_cannot_be_sure_of_goes_to_rust_with_the_same_ids(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    rust = tokenizer.tokenizer.backend_tokenizer
    for text in ["naïve café ü", "日本語のテキスト", "emoji 🙂 here"]:
        assert tokenizer._pretokens.encode(text) is None
        assert tokenizer.encode_now(text) == rust.encode(text).ids


def test_special_tokens_encoded_as_text_go_to_rust(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    rust = tokenizer.tokenizer.backend_tokenizer
    text = "x<|im_start|>user"  # a marker the embedded model's tokenizer knows
    rust.encode_special_tokens = True  # transformers' split_special_tokens
    try:
        assert tokenizer._pretokens.encode(text) is None
        assert tokenizer.encode_now(text) == rust.encode(text).ids
    finally:
        rust.encode_special_tokens = False


@pytest.mark.parametrize("change", ["normalizer", "lstrip_token", "prefix_space", "normalized_and_not"])
def test_tokenizers_of_another_shape_are_left_to_rust(tmp_path, change):
    rust = llama3_style(tmp_path)
    if change == "normalizer":
        rust.normalizer = normalizers.Lowercase()
    elif change == "lstrip_token":
        rust.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    elif change == "normalized_and_not":  # Rust matches these after the others, in a second pass
        rust.add_tokens([AddedToken("x<|", normalized=True)])
    else:
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    cache = PretokenCache(rust)
    assert not cache.usable and cache.encode("hello world") is None


def test_a_full_cache_starts_over_and_still_gives_rusts_ids(model_dir, monkeypatch):
    monkeypatch.setattr("coordinator.requests.pretoken_cache.MAX_ENTRIES", 16)
    rust = PromptTokenizer(model_dir).tokenizer.backend_tokenizer
    cache = PretokenCache(rust)
    most = 0
    for text in texts(3, 50):
        assert cache.encode(text) == rust.encode(text).ids, repr(text)
        most = max(most, len(cache._split(text)))
    assert len(cache._ids) <= 16 + most  # one text's pre-tokens at most beyond the bound
