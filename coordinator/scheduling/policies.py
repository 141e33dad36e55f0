"""Selection policies (`digs_scheduler_config.algorithm_type`): given healthy candidates, pick one.

Load figures combine what the worker last reported with what this coordinator has sent it since,
taking the larger, so a burst between two health checks still spreads out and the load other
coordinators put on a worker still counts.
"""

from __future__ import annotations

from coordinator.instances import Instance
from coordinator.scheduling.prefix_index import PrefixIndex


def prefill_load(instance: Instance) -> int:
    """Prompt tokens waiting on a prefill instance."""
    return max(instance.reported.queued_prompt_tokens, instance.outstanding_prompt_tokens)


def decode_load(instance: Instance) -> float:
    """Sequences on a decode instance, with its KV use (0..1) as the tie-breaker."""
    sequences = max(instance.reported.num_running + instance.reported.num_waiting, instance.outstanding_requests)
    return sequences + instance.reported.kv_usage


class RoundRobinPolicy:
    """Each role's candidates in turn, whatever their load."""

    def __init__(self):
        self._turn = {"prefill": 0, "decode": 0}

    def _next(self, role: str, candidates: list[Instance]) -> Instance:
        ordered = sorted(candidates, key=lambda i: i.address)
        choice = ordered[self._turn[role] % len(ordered)]
        self._turn[role] += 1
        return choice

    def choose_prefill(self, candidates: list[Instance], prompt_token_ids: list[int]) -> Instance:
        return self._next("prefill", candidates)

    def choose_decode(self, candidates: list[Instance]) -> Instance:
        return self._next("decode", candidates)

    def on_prefill_routed(self, instance: Instance, prompt_token_ids: list[int]) -> None:
        pass


class LoadBalancePolicy(RoundRobinPolicy):
    """Least outstanding work: queued prompt tokens for prefill, sequences and KV use for decode.
    Ties go round robin, so equal instances share the work."""

    def _least(self, role: str, candidates: list[Instance], load) -> Instance:
        lowest = min(load(i) for i in candidates)
        return self._next(role, [i for i in candidates if load(i) == lowest])

    def choose_prefill(self, candidates: list[Instance], prompt_token_ids: list[int]) -> Instance:
        return self._least("prefill", candidates, prefill_load)

    def choose_decode(self, candidates: list[Instance]) -> Instance:
        return self._least("decode", candidates, decode_load)


class CacheAffinityPolicy(LoadBalancePolicy):
    """Prefill on the instance that most recently served the longest shared prompt prefix, unless
    its load passes `max_load_ratio` x the least loaded one's + `slack_tokens`; else least loaded."""

    def __init__(self, block_tokens: int = 16, max_load_ratio: float = 2.0, slack_tokens: int = 4096):
        super().__init__()
        self.index = PrefixIndex(block_tokens)
        self.max_load_ratio = max_load_ratio
        self.slack_tokens = slack_tokens

    def choose_prefill(self, candidates: list[Instance], prompt_token_ids: list[int]) -> Instance:
        owner, matched = self.index.longest_match(prompt_token_ids)
        affine = next((i for i in candidates if i.address == owner), None) if matched else None
        if affine is not None:
            least = min(prefill_load(i) for i in candidates)
            if prefill_load(affine) <= least * self.max_load_ratio + self.slack_tokens:
                return affine
        return super().choose_prefill(candidates, prompt_token_ids)

    def on_prefill_routed(self, instance: Instance, prompt_token_ids: list[int]) -> None:
        self.index.record(prompt_token_ids, instance.address)


def make_policy(config) -> RoundRobinPolicy:
    """The policy named by a SchedulerConfig."""
    if config.algorithm_type == "load_balance":
        return LoadBalancePolicy()
    if config.algorithm_type == "cache_affinity":
        return CacheAffinityPolicy(config.cache_affinity_block_tokens, config.cache_affinity_max_load_ratio,
                                   config.cache_affinity_load_slack_tokens)
    return RoundRobinPolicy()
