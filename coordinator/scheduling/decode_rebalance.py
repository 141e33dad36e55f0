"""Decode rebalancing: streams already running on a crowded decode instance move to one with room, as a stream
whose decode worker was lost does (the prompt and the tokens sent so far are prefilled again, and another decode
worker continues the stream). Routing places only new requests, so without it a decode worker that joins (a
scale-up, a role switch) takes none of the streams that crowd the others, and their TPOT stays high to the end.

One round, every `rebalance_config.interval_s`:
  1. The routable decode instances and the requests this coordinator has on each (`outstanding_requests`).
  2. While the busiest has at least `min_imbalance` more than the least busy, and at least twice as many (a
     smaller gap evens out by itself: routing sends each new request to the least busy), one of the busiest's
     relaying streams moves: the one with the most tokens still to make, at least `min_tokens_left` (a move costs a
     prefill of its prompt and tokens so far, which a short rest does not repay). Up to `max_moves` per round.
     What a continuation could not give the client unchanged stays: guided and multimodal streams (a vLLM
     instance cannot continue them), stop strings and presence/frequency penalties (the new worker would see only
     the tokens after the move), a client's seed (the sampled sequence would change); a stream moves once at most.
     Nor one whose last token's text did not go out whole: its worker holds back the bytes of an unfinished
     character, which the new worker could not complete (a later round may pick it).
  3. A stream told to move leaves at its next read (`MovableStream`); tokens that reach it after it was told go
     nowhere, so it continues from what the client had then. The pipeline routes its continuation away from the
     instance it left, by the policy as any request (load_balance: the least busy). A stream told to move and not
     gone yet counts as gone in the next round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from coordinator.periodic_rounds import PeriodicRounds

if TYPE_CHECKING:
    from coordinator.requests.attempt import Progress
    from coordinator.requests.request import GenerationRequest
    from coordinator.workers.instances import InstanceRegistry

logger = logging.getLogger(__name__)

CROWDED = 2.0  # the busiest instance holds at least this many times the least busy one's requests


class RebalanceConfig(BaseModel):
    """`rebalance_config` in ms_coordinator.json: moving running streams between decode instances."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Move running streams off a decode instance with `min_imbalance` more "
                          "requests than another, and twice as many (prefilled again, continued there); `pdserve up "
                          "--autoscale` turns it on. Off: a stream stays where it started unless its worker is lost "
                          "or drains.")
    interval_s: float = Field(1.0, ge=0.1, le=60, description="Seconds between rebalancing rounds.")
    min_imbalance: int = Field(4, ge=2, le=100_000, description="Least difference in requests between the busiest "
                               "and the least busy decode instance before a stream moves.")
    min_tokens_left: int = Field(64, ge=1, le=1_000_000, description="A stream moves only with at least this many "
                                 "tokens still to make (of its max_tokens): a move costs a prefill of its prompt "
                                 "and the tokens so far.")
    max_moves: int = Field(8, ge=1, le=10_000, description="Most streams moved in one round.")


class MovableStream:
    """A stream relaying from a decode instance. `move()` makes it leave at its next read: at once when its task
    waits on the stream (the task is cancelled, as `_PrefillInterrupt` does, and takes the cancellation back),
    else when it comes back to read (never while it writes to its client). From `move()` on, the tokens it still
    gets go nowhere (`guard`): the stream continues elsewhere from the tokens the client had then."""

    __slots__ = ("progress", "end", "address", "wanted", "_task", "_reading", "_cancelling", "_fired")

    def __init__(self, progress: Progress, end: int, address: str):
        self.progress = progress
        self.end = end  # the request's token count when this attempt ends by length
        self.address = address
        self.wanted = False  # told to move
        self._task = asyncio.current_task()
        self._reading = self._fired = False
        self._cancelling = 0

    @property
    def tokens_left(self) -> int:
        return self.end - self.progress.count

    def move(self) -> bool:
        """Tell it to leave; False (nothing done) when it was told already, or when its last token's text did not
        go out whole: its worker holds bytes of an unfinished character, which another worker could not complete."""
        if self.wanted or self.progress.text_held:
            return False
        self.wanted = True
        if self._reading:
            self._fired = True
            self._task.cancel()
        return True

    def guard(self, take: Callable[[object], bool]) -> Callable[[object], bool]:
        """`take` (a listener's, for tokens delivered from their frames) refusing every token once told to move:
        a refused token is left to the task, which leaves without it."""
        return lambda token: not self.wanted and take(token)

    def reading(self) -> None:
        """The task is about to wait on the stream."""
        self._reading, self._cancelling = True, self._task.cancelling()

    def read_done(self) -> None:
        """The read ended without a CancelledError: one this move asked for was swallowed below; take it back."""
        self._reading = False
        if self._fired:
            self._fired = False
            self._task.uncancel()

    def interrupted(self) -> bool:
        """In the task's CancelledError handler: whether the cancellation was this move's (then taken back, unless
        another one is pending, which must go on). Once: a later cancellation is someone else's."""
        self._reading = False
        fired, self._fired = self._fired, False
        return fired and self._task.uncancel() <= self._cancelling


def can_move(request: GenerationRequest) -> bool:
    """Whether a continuation on another decode worker gives the client what staying would (step 2)."""
    sampling = request.sampling
    return (sampling.guided is None and not request.media and not sampling.stop and not sampling.presence_penalty
            and not sampling.frequency_penalty and (sampling.seed is None or sampling.seed_drawn))


def pick_moves(loads: dict[str, int], streams: dict[str, list[MovableStream]], config: RebalanceConfig) -> list:
    """Step 2 of the module docstring, on a copy of the loads: the streams to move, in order."""
    loads, moves = dict(loads), []
    candidates = {address: sorted((s for s in streams.get(address, ()) if s.tokens_left >= config.min_tokens_left
                                   and not s.wanted and not s.progress.text_held), key=lambda s: s.tokens_left)
                  for address in loads}
    while len(moves) < config.max_moves and len(loads) > 1:
        quietest = min(loads, key=loads.get)
        movable = [address for address in loads if candidates[address]]
        if not movable:
            break
        busiest = max(movable, key=loads.get)  # of those with a stream that may move
        gap = loads[busiest] - loads[quietest]
        if gap < config.min_imbalance or loads[busiest] < CROWDED * loads[quietest]:
            break
        moves.append(candidates[busiest].pop())  # the most tokens left
        loads[busiest] -= 1
        loads[quietest] += 1
    return moves


class DecodeRebalancer:
    """Keeps the movable streams per decode instance and runs the rounds of the module docstring."""

    def __init__(self, config: RebalanceConfig, registry: InstanceRegistry):
        self.config = config
        self.registry = registry
        self.streams: dict[str, set[MovableStream]] = {}
        self.rounds = PeriodicRounds(self.round, config.interval_s, "rebalance round")

    def relaying(self, progress: Progress, end: int, address: str) -> MovableStream:
        stream = MovableStream(progress, end, address)
        self.streams.setdefault(address, set()).add(stream)
        return stream

    def done(self, stream: MovableStream) -> None:
        held = self.streams.get(stream.address)
        if held is not None:
            held.discard(stream)
            if not held:
                del self.streams[stream.address]

    def move_all_off(self, address: str) -> int:
        """Tell every stream on `address` that may move to move now (a drain's budget ran out); how many were told."""
        told = [stream for stream in self.streams.get(address, ()) if stream.move()]
        if told:
            logger.info("drain: moving %d streams off decode instance %s", len(told), address)
        return len(told)

    def round(self) -> int:
        """Step 1 and 2; the number of streams told to move."""
        loads = {i.address: i.outstanding_requests for i in self.registry.available("decode")}
        for address, held in self.streams.items():  # told to move and not gone yet (writing to a slow client)
            if address in loads:
                loads[address] -= sum(1 for stream in held if stream.wanted)
        moves = pick_moves(loads, {a: list(s) for a, s in self.streams.items() if a in loads}, self.config)
        for stream in moves:
            stream.move()
        if moves:
            logger.info("rebalance: moving %d streams off the busiest decode instances (requests per instance: %s)",
                        len(moves), dict(sorted(loads.items())))
        return len(moves)

