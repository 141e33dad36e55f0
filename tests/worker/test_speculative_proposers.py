"""Speculative decoding's proposers and drafting rules (no torch): what each method drafts from a text, and when a
row does not draft."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.sequence import SamplingParams, Sequence
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.drafter import Drafter
from worker.engine.speculative.proposers import NgramProposer, SuffixProposer, TokenHistory, suffix_matches


def text(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_ngram_drafts_what_followed_the_longest_earlier_match_of_the_texts_suffix():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    # "2 3" occurs after 1 (continued by 4 5) and after 9 (continued by 7): the suffix "9 2 3" matches 3 tokens there.
    assert proposer.propose(text(1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 9, 2, 3), [], 2) == [7, 8]


def test_ngram_takes_the_earliest_of_equally_long_matches():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert proposer.propose(text(5, 6, 1, 5, 6, 2, 5, 6), [], 3) == [1, 5, 6]


def test_ngram_drafts_nothing_below_the_shortest_match_and_stops_at_the_texts_end():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4))
    assert proposer.propose(text(1, 2, 3, 9, 3), [], 4) == []  # only "3" matches: one token, under the minimum
    assert proposer.propose(text(1, 2, 1, 2), [], 5) == [1, 2]  # the continuation runs into the suffix itself


def test_suffix_matches_report_each_occurrence_and_its_length():
    idx, lengths = suffix_matches(text(1, 2, 3), text(3, 2, 3, 1, 2, 3, 0), 7, 8)
    assert dict(zip(idx.tolist(), lengths.tolist())) == {0: 1, 2: 2, 5: 3}


def test_suffix_follows_the_most_frequent_continuation_and_stops_where_it_is_unlikely():
    config = SpeculativeConfig("suffix", suffix_min_token_prob=0.5, suffix_max_spec_factor=4)
    proposer = SuffixProposer(config)
    # After "1 2": 3 4 twice, 3 5 once. The draft is 3 (3/3), then 4 (2/3 -> 0.67), then nothing (0.67 * 1/2 < 0.5).
    own = text(1, 2, 3, 4, 0, 1, 2, 3, 4, 6, 1, 2, 3, 5, 7, 1, 2)
    assert proposer.propose(own, [], 8) == [3, 4]


def test_suffix_drafts_from_the_coordinators_hints_beside_the_requests_text():
    proposer = SuffixProposer(SpeculativeConfig("suffix", suffix_max_spec_factor=4))
    hint = text(8, 1, 2, 3, 4, 5, 6)
    assert proposer.propose(text(9, 9, 1, 2), [hint], 3) == [3, 4, 5]
    assert proposer.propose(text(9, 9, 1, 2), [], 3) == []


def test_suffix_drafts_at_most_the_factor_times_the_matchs_length():
    proposer = SuffixProposer(SpeculativeConfig("suffix", suffix_max_spec_factor=1.0))
    assert proposer.propose(text(5, 1, 2, 3, 4, 7, 1), [], 5) == [2]


def test_token_history_grows_without_losing_tokens():
    history = TokenHistory([1, 2])
    history.extend(list(range(200)))
    assert history.view.tolist() == [1, 2, *range(200)]


def seq(rid: str = "r", prompt=(1, 2, 3, 1, 2), max_tokens: int = 50, **fields) -> Sequence:
    s = Sequence(rid, len(prompt), SamplingParams(max_tokens=max_tokens), 512, prompt_token_ids=list(prompt), **fields)
    s.output_token_ids = [3]
    return s


def test_a_batch_over_the_threshold_drafts_nothing():
    drafter = Drafter(SpeculativeConfig(prompt_lookup_min=1, disable_batch_size=2))
    batch = [seq(str(i)) for i in range(3)]
    assert drafter.plan(batch) == [[], [], []]
    assert drafter.counts.skipped["batch_size"] == 3
    assert drafter.plan(batch[:2]) == [[1, 2, 3], [1, 2, 3]]


def test_a_row_whose_drafts_were_all_rejected_cools_down_longer_each_time():
    drafter = Drafter(SpeculativeConfig(prompt_lookup_min=1, cooldown_steps=2))
    row = seq()
    assert drafter.plan([row]) == [[1, 2, 3]]
    drafter.verified(row, 3, 0)
    assert drafter.plan([row]) == [[]] and drafter.plan([row]) == [[]]  # two steps off
    assert drafter.plan([row]) != [[]]
    drafter.verified(row, 3, 0)
    assert [drafter.plan([row]) for _ in range(4)] == [[[]]] * 4  # then four
    assert drafter.counts.skipped["cooldown"] == 6
    assert drafter.plan([row]) != [[]]
    drafter.verified(row, 3, 2)  # an acceptance ends the cool-down
    assert drafter.plan([row]) != [[]]
    assert row.drafts.mean_acceptance_length == pytest.approx(1 + 2 / 3)


def test_rows_turned_off_guided_or_at_their_last_tokens_do_not_draft():
    drafter = Drafter(SpeculativeConfig(prompt_lookup_min=1))
    off, guided, last = seq("a", no_drafts=True), seq("b"), seq("c", max_tokens=2)
    guided.matcher = object()
    assert drafter.plan([off, guided, last]) == [[], [], []]
    assert {r: drafter.counts.skipped[r] for r in ("request_off", "guided", "length")} == \
        {"request_off": 1, "guided": 1, "length": 1}


def test_a_draft_never_runs_past_the_tokens_the_request_may_still_generate():
    drafter = Drafter(SpeculativeConfig(prompt_lookup_min=1, num_speculative_tokens=8))
    assert drafter.plan([seq(max_tokens=4)]) == [[1, 2]]  # 1 generated; 2 drafted + 1 emitted = 4


@pytest.mark.parametrize("fields, message", [
    ({"method": "eagle"}, "--speculative-method"), ({"num_speculative_tokens": 0}, "--num-speculative-tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "--prompt-lookup-min"),
    ({"disable_batch_size": 0}, "--speculative-disable-batch-size")])
def test_settings_out_of_range_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)
