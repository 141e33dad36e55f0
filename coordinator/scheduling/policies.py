"""Selection policies (`digs_scheduler_config.algorithm_type`): pick one of a role's routable instances.

Load figures combine what the worker last reported with what this coordinator has sent it since,
taking the larger, so a burst between two health checks still spreads out and the load other
coordinators put on a worker still counts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from coordinator.instances import Instance, RolePool
from coordinator.scheduling.load_order import LoadOrder, nth_outside
from coordinator.scheduling.prefix_index import PrefixIndex


# Loads read only what an instance tells its pool of (state, reported, outstanding_*), so orders stay current.
def prefill_load(instance: Instance) -> int:
    """Prompt tokens waiting on a prefill instance."""
    return max(instance.reported.queued_prompt_tokens, instance.outstanding_prompt_tokens)


def decode_load(instance: Instance) -> float:
    """Sequences on a decode instance, with its KV use (0..1) as the tie-breaker."""
    sequences = max(instance.reported.num_running + instance.reported.num_waiting, instance.outstanding_requests)
    return sequences + instance.reported.kv_usage


class RoundRobinPolicy:
    """Each role's candidates in turn, whatever their load.

    Every policy picks from a RolePool (the registry's routable instances of one role, kept in address
    order) minus `exclude` (instances this request already failed on), and answers None when none is left.
    """

    def __init__(self):
        self._turn = {"prefill": 0, "decode": 0}

    def _next(self, pool: RolePool, ordered: list[str], exclude: Collection[str]) -> Instance | None:
        """The role's next turn among `ordered` (sorted addresses) outside `exclude`."""
        address = nth_outside(ordered, self._turn[pool.role], exclude)
        if address is None:
            return None
        self._turn[pool.role] += 1
        return pool.get(address)

    def choose_prefill(self, pool: RolePool, prompt_token_ids: list[int],
                       exclude: Collection[str] = frozenset()) -> Instance | None:
        return self._next(pool, pool.routable, exclude)

    def choose_decode(self, pool: RolePool, exclude: Collection[str] = frozenset()) -> Instance | None:
        return self._next(pool, pool.routable, exclude)

    def on_prefill_routed(self, instance: Instance, prompt_token_ids: list[int]) -> None:
        pass


class LoadBalancePolicy(RoundRobinPolicy):
    """Least outstanding work: queued prompt tokens for prefill, sequences and KV use for decode.
    Ties go round robin, so equal instances share the work."""

    def __init__(self):
        super().__init__()
        self._orders: dict[tuple[RolePool, Callable], LoadOrder] = {}

    def _order(self, pool: RolePool, load: Callable[[Instance], float]) -> LoadOrder:
        """The pool's instances ordered by `load`, built once and then kept current by the pool."""
        order = self._orders.get((pool, load))
        if order is None:
            order = self._orders[pool, load] = LoadOrder(pool, load)
        return order

    def _least(self, pool: RolePool, exclude: Collection[str], load) -> Instance | None:
        least = self._order(pool, load).least(exclude)
        return None if least is None else self._next(pool, least[1], exclude)

    def choose_prefill(self, pool: RolePool, prompt_token_ids: list[int],
                       exclude: Collection[str] = frozenset()) -> Instance | None:
        return self._least(pool, exclude, prefill_load)

    def choose_decode(self, pool: RolePool, exclude: Collection[str] = frozenset()) -> Instance | None:
        return self._least(pool, exclude, decode_load)


class CacheAffinityPolicy(LoadBalancePolicy):
    """Prefill on the instance that most recently served the longest shared prompt prefix, unless
    its load passes `max_load_ratio` x the least loaded one's + `slack_tokens`; else least loaded."""

    def __init__(self, block_tokens: int = 16, max_load_ratio: float = 2.0, slack_tokens: int = 4096):
        super().__init__()
        self.index = PrefixIndex(block_tokens)
        self.max_load_ratio = max_load_ratio
        self.slack_tokens = slack_tokens

    def choose_prefill(self, pool: RolePool, prompt_token_ids: list[int],
                       exclude: Collection[str] = frozenset()) -> Instance | None:
        owner, matched = self.index.longest_match(prompt_token_ids)
        if matched and owner not in exclude and pool.is_routable(owner):
            affine = pool.get(owner)
            least, _ = self._order(pool, prefill_load).least(exclude)
            if prefill_load(affine) <= least * self.max_load_ratio + self.slack_tokens:
                return affine
        return super().choose_prefill(pool, prompt_token_ids, exclude)

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
