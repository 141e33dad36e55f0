"""Drive one request through a prefill worker and a decode worker, as a stream of events.

A request's life in the coordinator:
  1. It waits its turn in the RequestQueue (`queue.py`: its tenant's fair share, then priority, then
     arrival) until its latest start: its deadline less its expected service time (`ServiceTimes`). One the
     line predicts cannot start by then is refused at once (503, Retry-After); one still waiting then leaves.
  2. An attempt (`attempt.py`): the router (`scheduling/router.py`) picks a decode and a prefill
     instance (or none, when the decode worker prefills a short prompt itself); each is leased from
     the registry (`workers/instances.py`) while it works on the request; the decode stream opens and is
     `accepted` once the decode worker holds KV budget; the prefill runs and pushes the KV cache;
     tokens are relayed. `workers/client.py` turns protobuf into these events and gRPC errors into
     WorkerCallError.
  3. A failure before the first token (a worker unreachable or gone, a KV transfer that failed or
     stalled; `failures.py` says which and whom to blame) starts a new attempt on other instances, up
     to `max_retry`, invisibly to the client. A decode worker lost mid-stream is replaced: the prompt
     plus the tokens already sent are prefilled again and another decode worker continues the stream
     (`max_migrations`). This loop is the RequestPipeline below.
  4. Every stage has a deadline: first_token_timeout, then the request's own timeout / infer_timeout,
     which is also the gRPC deadline of the decode call, so the workers free the request on expiry.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from coordinator.requests.attempt import AttemptFailed, AttemptRunner, Progress
from coordinator.errors import OVERLOADED, ApiError, WorkerError
from coordinator.workers.instances import InstanceRegistry
from coordinator.requests.limits import ModelLimits
from coordinator.metrics import CoordinatorMetrics, NullMetrics
from coordinator.requests.request import DEFAULT_PRIORITY, GenerationEvent, GenerationRequest, TokenListener
from coordinator.requests.queue import DEFAULT_LINE, CannotStartInTime, RequestQueue
from coordinator.requests.trace import GenerationTrace
from coordinator.scheduling.decode_rebalance import can_move
from coordinator.scheduling.router import Placement, Router
from coordinator.workers.client import WorkerClient
from proto.wire_versions import MAX_HELD_TEXT_TOKENS

if TYPE_CHECKING:
    from coordinator.planning.planner_loop import PlannerLoop
    from coordinator.requests.draft_corpus import DraftCorpus
    from coordinator.requests.encoding import ImageEncoding

logger = logging.getLogger(__name__)

SERVICE_EWMA = 0.1  # weight of a finished request in the expected service times


class ServiceTimes:
    """Recent requests' time from their turn to their first token, and per later token (moving averages), and how
    far a request's service strays from that (a moving mean deviation, as TCP's round-trip estimate keeps): a
    request's expected service time with a margin, so it leaves the line while it can still finish in time."""

    __slots__ = ("first_token_s", "token_s", "tokens", "deviation_s", "seen")

    def __init__(self):
        self.first_token_s = 0.0
        self.token_s = 0.0
        self.tokens = 0.0  # output tokens of a request
        self.deviation_s = 0.0
        self.seen = 0

    def _mean_s(self, tokens: float) -> float:
        return self.first_token_s + self.token_s * max(0.0, tokens - 1)

    def expected_s(self, max_tokens: int) -> float:
        if not self.seen:
            return 0.0
        return self._mean_s(min(max_tokens, self.tokens)) + 2 * self.deviation_s

    def observe(self, started: float, progress: Progress) -> None:
        if not progress.count:
            return
        weight = SERVICE_EWMA if self.seen >= 10 else 1.0 / (self.seen + 1)  # a plain mean over the first ten
        if self.seen:
            error = abs(progress.last_at - started - self._mean_s(progress.count))
            self.deviation_s += weight * (error - self.deviation_s)
        self.seen += 1
        self.first_token_s += weight * (progress.first_at - started - self.first_token_s)
        self.tokens += weight * (progress.count - self.tokens)
        if progress.count > 1:
            gap = (progress.last_at - progress.first_at) / (progress.count - 1)
            self.token_s += weight * (gap - self.token_s)


class RequestPipeline:
    """Queues, routes, retries and migrates requests; relays decode tokens as events."""

    def __init__(self, client: WorkerClient, router: Router, registry: InstanceRegistry, limits: ModelLimits,
                 queue: RequestQueue, first_token_timeout: float, infer_timeout: float,
                 metrics: CoordinatorMetrics | NullMetrics, max_retry: int = 0, max_migrations: int = 0):
        self.router = router
        self.limits = limits
        self.queue = queue
        self.infer_timeout = infer_timeout
        self.metrics = metrics
        self.max_retry = max_retry
        self.max_migrations = max_migrations
        self.attempts = AttemptRunner(client, registry, limits, first_token_timeout, self.metrics)
        self.planner: PlannerLoop | None = None  # with planner_config.enabled: told of every finished request
        self.drafts: DraftCorpus | None = None  # with speculative_config.enabled: hints out, finished outputs in
        self.encoding: ImageEncoding | None = None  # images to encode workers, where there are any
        self.service = ServiceTimes()

    async def generate(self, request: GenerationRequest,
                       listener: TokenListener | None = None) -> AsyncIterator[GenerationEvent]:
        """The request's events; with a `listener`, the tokens it accepts go to it instead, as they arrive."""
        max_tokens = self.limits.generation_cap(request.max_tokens, len(request.prompt_token_ids))
        timeout = min(self.infer_timeout, request.timeout_s or self.infer_timeout)
        deadline = request.arrived_at + timeout
        trace = GenerationTrace(self.metrics)
        ticket = request.ticket
        # Its images go to encode workers now, while it waits its turn (encoding.py).
        encoding = self.encoding.start(request, deadline) if self.encoding is not None else None
        try:
            await self._wait_turn(request, max_tokens, deadline, timeout, trace)
            live = None
            try:
                if encoding is not None:
                    request = await encoding.placed(request, trace)
                    encoding = None
                request = self._with_drafting(request)
                progress = Progress()
                if ticket is not None:
                    ticket.streams.append(progress)  # its tokens are charged to the tenant as they stream
                live = self.planner.arrived(request, max_tokens, progress) if self.planner is not None else None
                started = time.monotonic()
                async for event in self._attempts(request, max_tokens, deadline, timeout, trace, listener, progress):
                    yield event
                self.service.observe(started, progress)
                if self.drafts is not None:
                    self.drafts.learn(request, progress.token_ids)
                if live is not None:
                    self.planner.finished(live, trace)
            finally:
                self.queue.release()
                if live is not None and not live.finished:  # failed, or its client left
                    self.planner.abandoned(live)
        finally:
            if encoding is not None:  # it left the line early
                encoding.cancel()
            trace.finish()

    def _with_drafting(self, request: GenerationRequest) -> GenerationRequest:
        """The request as dispatched: with its draft hints from the corpus, unless its client turned drafting off."""
        if request.no_drafts:
            self.metrics.drafting_off()
            return request
        hints = self.drafts.hints_for(request) if self.drafts is not None else ()
        if not hints:
            return request
        return dataclasses.replace(request, draft_hints=hints)  # counted as sent where they go (attempt.py)

    async def _wait_turn(self, request: GenerationRequest, max_tokens: int, deadline: float, timeout: float,
                         trace: GenerationTrace) -> None:
        """Wait in the line until the request's turn, at most until its latest start; refused (503, Retry-After)
        when it cannot start by then, 504 when the deadline itself passed."""
        ticket = request.ticket
        # Without early refusal a request waits until its deadline, as it always did.
        latest_start = deadline - self.service.expected_s(max_tokens) if self.queue.refuse_early else deadline
        try:
            await self.queue.acquire(request.priority or DEFAULT_PRIORITY, latest_start - time.monotonic(),
                                     ticket.tenant.line if ticket is not None else DEFAULT_LINE)
        except CannotStartInTime as refused:
            self._refused_for_deadline(request)
            wait = max(1, round(refused.wait_s))
            if latest_start <= refused.at:
                why = (f"its expected service time ({deadline - latest_start:.1f}s) leaves no time to wait within "
                       f"its {timeout:g}s timeout")
            else:
                why = f"it would start in about {wait}s, too late for its {timeout:g}s timeout"
            raise ApiError(503, f"the coordinator's queue is full: {why}", headers={"Retry-After": str(wait)},
                           error_type=OVERLOADED) from None
        except TimeoutError:
            # Left at its latest start, before the deadline (the timer may fire a hair early: not compared to now).
            if latest_start < deadline:
                self._refused_for_deadline(request)
                raise ApiError(503, f"request left the coordinator's queue: it could no longer finish within its "
                                    f"{timeout:g}s timeout", headers={"Retry-After": "1"},
                               error_type=OVERLOADED) from None
            raise WorkerError(f"request waited {timeout}s in the coordinator's queue (timeout) and was dropped",
                              status=504) from None
        finally:  # a request dropped from the line (or whose client left) waited too
            queued_until = time.monotonic()
            trace.phase("queue", request.arrived_at, queued_until)
            if ticket is not None:
                ticket.tenant.queued += 1
                ticket.tenant.queue_seconds += queued_until - request.arrived_at
        self.metrics.queued(queued_until - request.arrived_at)

    @staticmethod
    def _refused_for_deadline(request: GenerationRequest) -> None:
        if request.ticket is not None:
            request.ticket.refused_for_deadline()

    def _routed(self, placement: Placement, prompt_tokens: int, trace: GenerationTrace) -> None:
        prefill = placement.prefill.address if placement.prefill is not None else None
        trace.route_chosen(prefill, placement.decode.address, prompt_tokens, placement.prefill_cached_tokens,
                           placement.decode_cached_tokens)
        if self.router.policy.prices_cache:
            self.metrics.routed("decode", placement.decode.address, prompt_tokens, placement.decode_cached_tokens)
            if prefill is not None:
                self.metrics.routed("prefill", prefill, prompt_tokens, placement.prefill_cached_tokens)

    async def _attempts(self, request: GenerationRequest, max_tokens: int, deadline: float, timeout: float,
                        trace: GenerationTrace, listener: TokenListener | None, progress: Progress):
        excluded = {"prefill": set(), "decode": set()}
        retries = migrations = moves = 0
        migrating = False
        moved_off: str | None = None  # the decode instance a rebalance just moved it off
        movable = self.attempts.rebalancer is not None and can_move(request)  # and one move at most
        last: AttemptFailed | None = None
        while True:
            number = progress.attempts  # retries + migrations + moves so far
            progress.attempts += 1
            trace.start_attempt(number, migrating)
            try:
                started = time.monotonic()
                # As the prefix caches hash it: a repeated image goes where its blocks are.
                prompt = request.cache_token_ids(progress.token_ids)
                route = functools.partial(self.router.route, prompt,
                                          exclude_prefill=excluded["prefill"],
                                          lora=request.lora.name if request.lora is not None else None,
                                          # prompt logprobs are a prefill worker's
                                          local_prefill=request.sampling.prompt_logprobs is None,
                                          # a worker pulls only blocks whose cache ids are the prompt's ids
                                          pullable=request.lora is None and not request.media,
                                          prefill_at=request.prefill_at)
                try:
                    placement = route(exclude_decode=excluded["decode"] | ({moved_off} if moved_off else set()))
                except WorkerError:
                    if moved_off is None:
                        raise
                    placement = route(exclude_decode=excluded["decode"])  # nowhere else now: back where it was
                trace.phase("route", started, time.monotonic())
                self._routed(placement, len(prompt), trace)
            except WorkerError as exc:
                trace.end_attempt(exc.message)
                if last is not None and not last.rebalanced:  # no instance left to retry on: the failure says more
                    raise last.error from None
                raise
            except BaseException:
                trace.end_attempt("routing failed")
                raise
            attempt = request.continued(progress.token_ids, number,
                                        min(progress.held_text_tokens, MAX_HELD_TEXT_TOKENS))
            moved_off = None
            try:
                async for event in self.attempts.run(attempt, placement, max_tokens - progress.count, deadline,
                                                     timeout, progress, len(request.prompt_token_ids), trace,
                                                     listener, movable and moves == 0):
                    yield event
                return
            except AttemptFailed as failed:
                trace.end_attempt(failed.error.message)
                last = failed
                if not failed.retryable:
                    raise failed.error from None
                if failed.embeddings_lost and any(m.encoder for m in request.media):
                    self.encoding.counters.count("pull_failed", sum(1 for m in request.media if m.encoder))
                    request = request.with_encoders({})  # once: the files now, on the same instances
                    logger.warning("request %s: %s; sending the images' files instead", request.request_id,
                                   failed.error.message)
                    continue
                if failed.rebalanced:  # not a failure: its own count, and the instance stays a candidate
                    moves, moved_off, migrating = moves + 1, failed.blame.address, True
                    self.metrics.rebalanced()
                    logger.info("request %s: %s after %d tokens", request.request_id, failed.error.message,
                                progress.count)
                    continue
                migrating = failed.blame.role == "decode" and progress.count > 0
                if migrating and migrations < self.max_migrations:
                    migrations += 1
                    self.metrics.migrated()
                elif not migrating and retries < self.max_retry:
                    retries += 1
                    self.metrics.retried()
                else:
                    raise failed.error from None
                excluded[failed.blame.role].add(failed.blame.address)
                logger.warning("request %s: %s; %s on other instances after %d tokens", request.request_id,
                               failed.error.message, "migrating" if migrating else "retrying", progress.count)
            finally:
                trace.end_attempt()  # done, or the client left
