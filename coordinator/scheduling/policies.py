"""Selection policies (`digs_scheduler_config.algorithm_type`): pick one of a role's routable instances.

Load figures combine what the worker last reported with what this coordinator has sent it since,
taking the larger, so a burst between two health checks still spreads out and the load other
coordinators put on a worker still counts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from coordinator.workers.instances import Instance, RolePool
from coordinator.scheduling.kv_index import NO_MATCH, CacheMatch, KvIndex
from coordinator.scheduling.load_order import LoadOrder, nth_outside


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
    `cached` maps the instances that hold a leading part of the prompt to its length in tokens (the
    KvIndex's CacheMatch for that role; empty unless the policy has an index).
    """

    prices_cache = False  # whether it routes on what the instances hold (its choices' expected hits are counted)
    reads_load = False  # whether it reads the load instances report (else a vLLM instance's /metrics is not read)

    def __init__(self):
        self._turn = {"prefill": 0, "decode": 0}

    def match(self, prompt_token_ids: list[int]) -> CacheMatch:
        """What each instance holds of the prompt: nothing known, for a policy without an index."""
        return NO_MATCH

    def expect(self, prefill: Instance | None, decode: Instance, prompt_token_ids: list[int]) -> None:
        """The request was placed on these instances: nothing to remember, for a policy without an index."""

    def pull_source(self, match: CacheMatch, prefill: str, held: int,
                    exclude: Collection[str] = frozenset()) -> tuple[str, int]:
        """Where the prefill instance pulls the prompt's leading blocks from, and how many positions: none."""
        return "", 0

    def _next(self, pool: RolePool, ordered: list[str], exclude: Collection[str]) -> Instance | None:
        """The role's next turn among `ordered` (sorted addresses) outside `exclude`."""
        address = nth_outside(ordered, self._turn[pool.role], exclude)
        if address is None:
            return None
        self._turn[pool.role] += 1
        return pool.get(address)

    def choose_prefill(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                       exclude: Collection[str] = frozenset(), lora: str | None = None,
                       match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._next(pool, pool.routable, exclude)

    def choose_decode(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                      exclude: Collection[str] = frozenset(), lora: str | None = None,
                      match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._next(pool, pool.routable, exclude)


class LoadBalancePolicy(RoundRobinPolicy):
    """Least outstanding work: queued prompt tokens for prefill, sequences and KV use for decode.
    Ties go round robin, so equal instances share the work."""

    reads_load = True

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

    def choose_prefill(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                       exclude: Collection[str] = frozenset(), lora: str | None = None,
                       match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._least(pool, exclude, prefill_load)

    def choose_decode(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                      exclude: Collection[str] = frozenset(), lora: str | None = None,
                      match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._least(pool, exclude, decode_load)


class CacheAffinityPolicy(LoadBalancePolicy):
    """The cheapest instance by what it holds of the prompt (the KvIndex, from the workers' KV events) and its load:

    - prefill: uncached prompt tokens + `prefill_load_weight` x its queued prompt tokens (the tokens it must
      compute before this request's first token);
    - decode: uncached prompt tokens (to transfer, or to prefill locally) + `decode_load_weight` x its running
      sequences, so a conversation's next turn goes back to the decode worker that holds it unless that one
      carries that much more load;
    - either, for a request under a LoRA adapter: + `lora_load_tokens` where the adapter is not loaded yet;
    - a prompt token held only in an instance's KV tier counts `tier_token_cost` of an uncached one (its block is
      loaded back, not computed); on a prefill instance, prompt tokens only expected there (a request just sent
      there is computing them) do not count as load ahead of this one: this request needs them computed anyway;
    - with peer pulls, a prefill instance lacking leading tokens another instance holds (`pull_source`) counts
      those at `pull_token_cost` (it fetches them from that one) when they are at least `pull_min_tokens`.
    Only the least loaded instance and those holding part of the prompt are priced, so a request costs the same
    whatever the size of the fleet (but for a LoRA request whose adapter the least loaded has not loaded: the
    instances that have are priced too).
    """

    prices_cache = True

    def __init__(self, index: KvIndex, prefill_load_weight: float = 1.0, decode_load_weight: float = 64.0,
                 lora_load_tokens: float = 256.0, tier_token_cost: float = 0.1, peer_pulls: bool = False,
                 pull_min_tokens: int = 64, pull_token_cost: float = 0.2):
        super().__init__()
        self.peer_pulls = peer_pulls
        self.pull_min_tokens = pull_min_tokens
        self.pull_token_cost = pull_token_cost
        self.index = index
        self.prefill_load_weight = prefill_load_weight
        self.decode_load_weight = decode_load_weight
        self.lora_load_tokens = lora_load_tokens
        self.tier_token_cost = tier_token_cost

    def match(self, prompt_token_ids: list[int]) -> CacheMatch:
        return self.index.match(prompt_token_ids)

    def pull_source(self, match: CacheMatch, prefill: str, held: int,
                    exclude: Collection[str] = frozenset()) -> tuple[str, int]:
        if not self.peer_pulls or not match.pullable:
            return "", 0
        source, best = "", held + self.pull_min_tokens - 1
        for tokens_by in (match.prefill, match.decode):
            for address, tokens in tokens_by.items():
                tokens -= match.expected.get(address, 0)  # only what it holds now can be read from it
                if tokens > best and address != prefill and address not in exclude:
                    source, best = address, tokens
        return (source, best) if source else ("", 0)

    def expect(self, prefill: Instance | None, decode: Instance, prompt_token_ids: list[int]) -> None:
        addresses = [decode.address] if prefill is None else [prefill.address, decode.address]
        self.index.expect(addresses, prompt_token_ids)

    def _cheapest(self, pool: RolePool, prompt_len: int, cached: dict[str, int], exclude: Collection[str],
                  load: Callable[[Instance], float], weight: float, lora: str | None,
                  match: CacheMatch) -> Instance | None:
        best = self._least(pool, exclude, load)
        if best is None:
            return best
        candidates = list(cached)
        if lora is not None and lora not in best.reported.loras:
            # Where the adapter is loaded already is priced too (a scan of the pool, for LoRA requests only).
            candidates += [a for a in pool.routable if a not in cached and lora in pool.get(a).reported.loras]
        if not candidates:
            return best

        tier, expected = match.tier, match.expected if load is prefill_load else {}
        peer = 0  # the most leading tokens any instance holds now, which a prefill instance may pull
        if self.peer_pulls and load is prefill_load:
            peer = self.pull_source(match, "", 0)[1]

        def cost(instance: Instance) -> float:
            address = instance.address
            held = cached.get(address, 0)
            if peer - held >= self.pull_min_tokens:
                c = prompt_len - peer + self.pull_token_cost * (peer - held) + weight * load(instance)
            else:
                c = prompt_len - held + weight * load(instance)
            if tier or expected:
                c += self.tier_token_cost * tier.get(address, 0)
                c -= weight * min(expected.get(address, 0), load(instance))
            if lora is not None and lora not in instance.reported.loras:
                c += self.lora_load_tokens
            return c

        best_cost = cost(best)
        for address in candidates:
            if address in exclude or not pool.is_routable(address):
                continue
            instance = pool.get(address)
            c = cost(instance)
            if c < best_cost:
                best, best_cost = instance, c
        return best

    def choose_prefill(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                       exclude: Collection[str] = frozenset(), lora: str | None = None,
                       match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._cheapest(pool, prompt_len, cached, exclude, prefill_load, self.prefill_load_weight, lora, match)

    def choose_decode(self, pool: RolePool, prompt_len: int, cached: dict[str, int],
                      exclude: Collection[str] = frozenset(), lora: str | None = None,
                      match: CacheMatch = NO_MATCH) -> Instance | None:
        return self._cheapest(pool, prompt_len, cached, exclude, decode_load, self.decode_load_weight, lora, match)


def make_policy(config, index: KvIndex | None = None, peer_pulls: bool | None = None) -> RoundRobinPolicy:
    """The policy named by a SchedulerConfig (cache_affinity routes on `index`; `peer_pulls`: whether the workers can
    pull, default as configured)."""
    if config.algorithm_type == "load_balance":
        return LoadBalancePolicy()
    if config.algorithm_type == "cache_affinity":
        peer_pulls = config.cache_affinity_peer_pulls if peer_pulls is None else peer_pulls
        if index is None:
            raise ValueError("cache_affinity routes on a KvIndex")
        return CacheAffinityPolicy(index, config.cache_affinity_prefill_load_weight,
                                   config.cache_affinity_decode_load_weight, config.cache_affinity_lora_load_tokens,
                                   config.cache_affinity_tier_token_cost, peer_pulls,
                                   config.cache_affinity_pull_min_tokens, config.cache_affinity_pull_token_cost)
    return RoundRobinPolicy()
