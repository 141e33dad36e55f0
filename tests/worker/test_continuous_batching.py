"""The decode batch: a sequence's greedy tokens do not depend on what else is in the batch."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.model_runner import ModelRunner
from worker.engine.sequence import SamplingParams, Sequence

NUM_NEW = 12


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 90))] for _ in range(16)]


@pytest.fixture(scope="module")
def reference(runner, prompts) -> list[list[int]]:
    with torch.inference_mode():
        return [runner.model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


class Harness:
    """Drives ModelRunner the way DecodeEngine does, with joins and leaves at chosen steps."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seqs: dict[str, Sequence] = {}

    def join(self, rid: str, prompt: list[int]) -> None:
        logits, rows = self.runner.prefill([prompt])
        seq = Sequence(rid, len(prompt), SamplingParams(max_tokens=NUM_NEW), max_seq_len=4096)
        seq.output_token_ids.append(int(logits[0].argmax()))
        self.runner.join(seq, rows[0])
        self.seqs[rid] = seq

    def leave(self, rid: str) -> list[int]:
        self.runner.leave(rid)
        return self.seqs.pop(rid).output_token_ids

    def step(self) -> None:
        seqs = list(self.seqs.values())
        logits = self.runner.decode(seqs)
        for row, seq in enumerate(seqs):
            seq.output_token_ids.append(int(logits[row].argmax()))

    def run_until_done(self) -> dict[str, list[int]]:
        done = {}
        while self.seqs:
            self.step()
            for rid in [r for r, s in self.seqs.items() if s.num_generated >= NUM_NEW]:
                done[rid] = self.leave(rid)
        return done


def test_batch_of_16_mixed_lengths_matches_each_sequence_alone(runner, prompts, reference):
    harness = Harness(runner)
    for i, p in enumerate(prompts):
        harness.join(str(i), p)
    assert len(runner.batch) == 16
    done = harness.run_until_done()
    assert [done[str(i)] for i in range(16)] == reference
    assert len(runner.batch) == 0 and runner.batch.cache is None


def test_sequences_joining_and_leaving_mid_batch_do_not_change_the_others(runner, prompts, reference):
    harness = Harness(runner)
    for i in range(0, 8):
        harness.join(str(i), prompts[i])
    for _ in range(3):
        harness.step()
    # Late joiners, the longest prompts among them, widen the batch for everyone already in it.
    for i in sorted(range(8, 16), key=lambda i: -len(prompts[i]))[:4]:
        harness.join(str(i), prompts[i])
    for _ in range(2):
        harness.step()
    cancelled = {str(i): harness.leave(str(i)) for i in (1, 4, 6)}  # leave early: cancelled mid-stream
    done = harness.run_until_done()
    for rid, tokens in done.items():
        assert tokens == reference[int(rid)], f"sequence {rid} changed"
    for rid, tokens in cancelled.items():
        assert tokens == reference[int(rid)][: len(tokens)]
    assert runner.batch.cache is None


def test_batched_prefill_matches_prefill_alone(runner, prompts):
    alone = [runner.prefill([p]) for p in prompts[:6]]
    logits, rows = runner.prefill(prompts[:6])
    for i, (one_logits, one_rows) in enumerate(alone):
        assert int(logits[i].argmax()) == int(one_logits[0].argmax())
        for (k, v), (k1, v1) in zip(rows[i], one_rows[0]):
            assert k.shape == k1.shape
            torch.testing.assert_close(k, k1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, v1, rtol=1e-4, atol=1e-5)


def test_prefill_hands_out_every_layer_during_the_forward(runner, prompts):
    seen = []
    runner.prefill(prompts[:3], on_layer=lambda i, k, v: seen.append((i, k.shape[0])))
    assert seen == [(i, 3) for i in range(runner.num_layers)]


def test_long_decodes_that_regrow_the_buffers_still_leave_cleanly(runner, prompts):
    harness = Harness(runner)
    for i in range(3):
        harness.join(str(i), prompts[i])
    for _ in range(150):  # past the buffers' first right-hand slack: reallocated mid-decode
        harness.step()
    harness.join("late", prompts[5])
    harness.leave("1")
    harness.step()
    harness.leave("0")
    harness.leave("2")
    harness.leave("late")
    assert runner.batch.cache is None
