"""One-time KV transfer tokens: redeemed once, by the right token only, gone with the request."""

from __future__ import annotations

import threading

import pytest

from kv_transfer.transfer_tokens import KvTransferTokens


def test_issued_token_is_redeemed_once():
    tokens = KvTransferTokens()
    token = tokens.issue("r1")
    assert tokens.redeem("r1", token)
    assert not tokens.redeem("r1", token)
    assert len(tokens) == 0


def test_tokens_are_unguessably_long_and_differ_per_request():
    tokens = KvTransferTokens()
    issued = {tokens.issue(f"r{i}") for i in range(100)}
    assert len(issued) == 100 and min(len(t) for t in issued) >= 40


def test_wrong_or_missing_token_does_not_spend_the_genuine_one():
    tokens = KvTransferTokens()
    token = tokens.issue("r1")
    for guess in ("", "wrong", token[:-1], token + "x", "é" * 43):
        assert not tokens.redeem("r1", guess)
    assert tokens.redeem("r1", token)


def test_token_of_one_request_does_not_open_another():
    tokens = KvTransferTokens()
    token = tokens.issue("r1")
    tokens.issue("r2")
    assert not tokens.redeem("r2", token)
    assert not tokens.redeem("unknown", token)
    assert len(tokens) == 2


def test_revoked_token_is_refused():
    tokens = KvTransferTokens()
    token = tokens.issue("r1")
    tokens.revoke("r1")
    tokens.revoke("never-issued")
    assert not tokens.redeem("r1", token) and len(tokens) == 0


def test_reissuing_replaces_the_earlier_token():
    tokens = KvTransferTokens()
    first = tokens.issue("r1")
    second = tokens.issue("r1")
    assert not tokens.redeem("r1", first)
    assert tokens.redeem("r1", second)


def test_racing_redeemers_of_one_token_succeed_exactly_once():
    tokens = KvTransferTokens()
    for round_ in range(50):
        token = tokens.issue(f"r{round_}")
        start, wins = threading.Barrier(8), []

        def redeem():
            start.wait()
            wins.append(tokens.redeem(f"r{round_}", token))

        threads = [threading.Thread(target=redeem) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(wins) == [False] * 7 + [True]
    assert len(tokens) == 0


def test_a_token_carries_the_adapter_it_was_issued_for():
    tokens = KvTransferTokens()
    token = tokens.issue("r1", lora_digest=b"\x01" * 16)
    assert tokens.redeem_for("r1", token) == b"\x01" * 16
    assert tokens.redeem_for("r2", tokens.issue("r2")) == b""


def test_a_stream_computed_under_another_adapter_is_refused_and_fails_its_request():
    from kv_transfer.base import KvTransferError
    from kv_transfer.sink import KvSink
    from kv_transfer.wire import header

    failed = []
    tokens = KvTransferTokens()
    sink = KvSink(lambda kv: None, lambda rid, msg: failed.append((rid, msg)), tokens,
                  assembler=lambda *args: pytest.fail("no stream may be opened"))
    token = tokens.issue("r1", lora_digest=b"\x01" * 16)
    with pytest.raises(KvTransferError, match="computed under the base model; this request runs under LoRA"):
        sink.open(header("r1", "float32", 1, (4, 1, 2), token), "tcp")
    assert failed and failed[0][0] == "r1"
