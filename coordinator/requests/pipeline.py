"""Drive one request through a prefill worker and a decode worker, as a stream of events.

A request's life in the coordinator:
  1. It waits its turn in the RequestQueue (`queue.py`: priority, then arrival), within its
     deadline.
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

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from coordinator.requests.attempt import AttemptFailed, AttemptRunner, Progress
from coordinator.errors import WorkerError
from coordinator.workers.instances import InstanceRegistry
from coordinator.requests.limits import ModelLimits
from coordinator.metrics import CoordinatorMetrics, NullMetrics
from coordinator.requests.request import GenerationEvent, GenerationRequest, TokenListener
from coordinator.requests.queue import RequestQueue
from coordinator.requests.trace import GenerationTrace
from coordinator.scheduling.router import Placement, Router
from coordinator.workers.client import WorkerClient

if TYPE_CHECKING:
    from coordinator.planning.planner_loop import PlannerLoop

logger = logging.getLogger(__name__)


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

    async def generate(self, request: GenerationRequest,
                       listener: TokenListener | None = None) -> AsyncIterator[GenerationEvent]:
        """The request's events; with a `listener`, the tokens it accepts go to it instead, as they arrive."""
        max_tokens = self.limits.generation_cap(request.max_tokens, len(request.prompt_token_ids))
        timeout = min(self.infer_timeout, request.timeout_s or self.infer_timeout)
        deadline = request.arrived_at + timeout
        trace = GenerationTrace(self.metrics)
        try:
            try:
                await self.queue.acquire(request.priority, deadline - time.monotonic())
            except TimeoutError:
                raise WorkerError(f"request waited {timeout}s in the coordinator's queue (timeout) and was dropped",
                                  status=504) from None
            finally:  # a request dropped from the line (or whose client left) waited too
                queued_until = time.monotonic()
                trace.phase("queue", request.arrived_at, queued_until)
            self.metrics.queued(queued_until - request.arrived_at)
            progress = Progress()
            live = self.planner.arrived(request, max_tokens, progress) if self.planner is not None else None
            try:
                async for event in self._attempts(request, max_tokens, deadline, timeout, trace, listener, progress):
                    yield event
                if live is not None:
                    self.planner.finished(live, trace)
            finally:
                self.queue.release()
                if live is not None and not live.finished:  # failed, or its client left
                    self.planner.abandoned(live)
        finally:
            trace.finish()

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
        retries = migrations = 0
        migrating = False
        last: AttemptFailed | None = None
        while True:
            trace.start_attempt(retries + migrations, migrating)
            try:
                started = time.monotonic()
                # As the prefix caches hash it: a repeated image goes where its blocks are.
                prompt = request.cache_token_ids(progress.token_ids)
                placement = self.router.route(prompt, exclude_decode=excluded["decode"],
                                              exclude_prefill=excluded["prefill"],
                                              lora=request.lora.name if request.lora is not None else None,
                                              # prompt logprobs are a prefill worker's
                                              local_prefill=request.sampling.prompt_logprobs is None,
                                              # a worker pulls only blocks whose cache ids are the prompt's ids
                                              pullable=request.lora is None and not request.media)
                trace.phase("route", started, time.monotonic())
                self._routed(placement, len(prompt), trace)
            except WorkerError as exc:
                trace.end_attempt(exc.message)
                if last is not None:  # no instance left to retry on: the failure itself says more
                    raise last.error from None
                raise
            except BaseException:
                trace.end_attempt("routing failed")
                raise
            attempt = request.continued(progress.token_ids, retries + migrations)
            try:
                async for event in self.attempts.run(attempt, placement, max_tokens - progress.count, deadline,
                                                     timeout, progress, len(request.prompt_token_ids), trace,
                                                     listener):
                    yield event
                return
            except AttemptFailed as failed:
                trace.end_attempt(failed.error.message)
                last = failed
                if not failed.retryable:
                    raise failed.error from None
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
