"""The draft corpus: outputs kept per tenant, model and adapter, found again by their prompt's tail, bounded in
count, tokens and memory (no servers)."""

from __future__ import annotations

import pytest

from adapters.peft_folder import AdapterRef
from coordinator.config import ConfigError, parse_config
from coordinator.requests.draft_corpus import ENTRY_TOKENS, TAIL_TOKENS, DraftCorpus, SpeculativeConfig
from coordinator.requests.limits import ModelLimits
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.tenancy.admission import Admission
from coordinator.tenancy.settings import TenancyConfig
from proto import worker_pb2 as pb
from tests.coordinator.tenancy.test_admission import http

A, B = ("team-a", "m", None), ("team-b", "m", None)
PROMPT = list(range(1000, 1100))  # 100 tokens: every default tail length fits


def corpus(**settings) -> DraftCorpus:
    return DraftCorpus(SpeculativeConfig(enabled=True, **settings), "m")


def lists(hints: tuple[bytes, ...]) -> list[list[int]]:
    return [list(pb.DraftHint.FromString(hint).token_ids) for hint in hints]


def test_a_repeated_prompt_gets_its_earlier_answers_back_most_recent_first():
    drafts = corpus()
    drafts.record(A, PROMPT, [1, 2, 3])
    drafts.record(A, PROMPT, [4, 5])
    assert lists(drafts.hints(A, PROMPT)) == [[4, 5], [1, 2, 3]]


def test_one_tenants_outputs_never_draft_for_another_tenants_request():
    drafts = corpus()
    drafts.record(A, PROMPT, [1, 2, 3])
    assert drafts.hints(B, PROMPT) == ()
    assert drafts.hints(("team-a", "m", "adapter-1"), PROMPT) == ()  # nor the base model's for an adapter's
    assert drafts.hints(("team-a", "other-model", None), PROMPT) == ()
    assert lists(drafts.hints(A, PROMPT)) == [[1, 2, 3]]


def test_the_longest_matching_tail_comes_first_whatever_came_later():
    drafts = corpus()
    same_64 = [7] * 10 + PROMPT[-64:]
    same_8 = [9] * 92 + PROMPT[-8:]
    drafts.record(A, same_64, [1])
    drafts.record(A, same_8, [2])  # more recent, but a shorter match
    drafts.record(A, [5] * 100, [3])  # no match at all
    assert lists(drafts.hints(A, PROMPT)) == [[1], [2]]


def test_a_short_prompt_matches_on_the_whole_of_it_and_shorter_than_min_tail_tokens_not_at_all():
    drafts = corpus(tail_lengths=[8], min_tail_tokens=4)
    drafts.record(A, [1, 2, 3, 4, 5], [10])
    assert lists(drafts.hints(A, [1, 2, 3, 4, 5])) == [[10]]
    assert drafts.hints(A, [0, 0, 0, 1, 2, 3, 4, 5]) == ()  # its last 8 are not that whole prompt
    drafts.record(A, [1, 2, 3], [11])
    assert drafts.hints(A, [1, 2, 3]) == () and drafts.num_entries == 1


def test_identical_outputs_are_kept_once_and_found_from_either_prompt():
    drafts = corpus()
    other = list(range(5000, 5100))
    drafts.record(A, PROMPT, [1, 2, 3])
    drafts.record(A, other, [1, 2, 3])
    assert drafts.num_entries == 1
    assert lists(drafts.hints(A, PROMPT)) == lists(drafts.hints(A, other)) == [[1, 2, 3]]
    assert drafts.num_tokens == 3 + ENTRY_TOKENS + 2 * 4 * TAIL_TOKENS  # two prompts, four tails each


def test_hints_are_bounded_in_count_and_in_tokens_each():
    drafts = corpus(max_hints=2, max_hint_tokens=5)
    for i in range(4):
        drafts.record(A, PROMPT, list(range(i * 100, i * 100 + 50)))
    assert lists(drafts.hints(A, PROMPT)) == [[300, 301, 302, 303, 304], [200, 201, 202, 203, 204]]


def test_a_corpus_past_its_budget_drops_its_least_recently_used_entries_whole_and_no_other_tenants():
    entry = 10 + ENTRY_TOKENS + 4 * TAIL_TOKENS  # a 10-token output under one prompt's four tails
    drafts = corpus(max_hint_tokens=10, max_corpus_tokens=3 * entry, max_total_tokens=100 * entry)
    drafts.record(B, PROMPT, [99] * 10)
    prompts = [list(range(i * 1000, i * 1000 + 100)) for i in range(5)]
    for i, prompt in enumerate(prompts[:3]):
        drafts.record(A, prompt, [i] * 10)
    drafts.hints(A, prompts[0])  # used: now the most recent
    drafts.record(A, prompts[3], [3] * 10)
    assert [len(drafts.hints(A, p)) for p in prompts[:4]] == [1, 0, 1, 1]  # the least recently used went
    assert lists(drafts.hints(B, PROMPT)) == [[99] * 10]
    assert drafts.num_entries == 4 and drafts.num_tokens == 4 * entry


def test_past_the_total_budget_the_least_recently_used_entry_of_any_tenant_goes():
    entry = 10 + ENTRY_TOKENS + 4 * TAIL_TOKENS
    drafts = corpus(max_hint_tokens=10, max_corpus_tokens=2 * entry, max_total_tokens=2 * entry)
    drafts.record(A, PROMPT, [1] * 10)
    drafts.record(B, PROMPT, [2] * 10)
    drafts.record(("team-c", "m", None), PROMPT, [3] * 10)
    assert drafts.hints(A, PROMPT) == () and drafts.num_entries == 2 and drafts.num_tokens == 2 * entry


def test_memory_stays_within_the_budgets_under_many_outputs():
    drafts = corpus(max_corpus_tokens=5_000, max_total_tokens=12_000)
    for i in range(2_000):
        tenant = (f"t{i % 5}", "m", None)
        drafts.record(tenant, [i % 7] * 20 + [i] * 80, [i] * (i % 300 + 1))
        assert drafts.num_tokens <= 12_000
    assert 0 < drafts.num_entries < 2_000


def test_the_requests_tenant_and_adapter_pick_its_corpus():
    admission = Admission(TenancyConfig(), ModelLimits(2048, 1024, 100, 2048))
    (request,) = admission.admit(http(), [GenerationRequest("r", PROMPT, SamplingOptions())])
    drafts = corpus()
    drafts.learn(request, [1, 2])
    assert drafts.key_of(request) == ("anonymous", "m", None)
    assert lists(drafts.hints_for(request)) == [[1, 2]]
    adapter = AdapterRef("a1", "/adapters/a1", 0x1234)
    assert drafts.hints_for(GenerationRequest("r", PROMPT, SamplingOptions(), lora=adapter,
                                              ticket=request.ticket)) == ()
    request.ticket.close()


@pytest.mark.parametrize("settings,needle", [
    ({"max_hints": 0}, "speculative_config.max_hints"),
    ({"max_hint_tokens": 0}, "speculative_config.max_hint_tokens"),
    ({"tail_lengths": [64, 0]}, "tail lengths must be in [1, 4096], got [0]"),
    ({"tail_lengths": []}, "speculative_config.tail_lengths"),
    ({"min_tail_tokens": 16}, "min_tail_tokens=16 exceeds the shortest of tail_lengths=[64, 32, 16, 8]"),
    ({"max_hint_tokens": 512, "max_corpus_tokens": 500}, "max_corpus_tokens=500 cannot hold one entry"),
    ({"max_corpus_tokens": 10_000, "max_total_tokens": 5_000}, "max_corpus_tokens=10000 exceeds max_total_tokens=5000"),
    ({"surprise": 1}, "speculative_config.surprise: unknown key"),
])
def test_a_bad_speculative_config_names_the_field_and_its_range(settings, needle):
    with pytest.raises(ConfigError) as err:
        parse_config({"speculative_config": settings})
    assert needle in str(err.value)


def test_tail_lengths_are_taken_longest_first_once_each():
    assert SpeculativeConfig(tail_lengths=[8, 32, 8, 16]).tail_lengths == [32, 16, 8]
