"""`pdserve profile`: measure a live worker (real or simulated) over its own gRPC API.

- Prefill: one Prefill call at a time per prompt length, its KV stream received and verified by a receiver
  this process runs (standing in for a decode worker). The worker's prefill_time_ms is the forward (nothing
  else is queued); the rest of the call is the handoff; kv_bytes / prompt tokens is the KV size per token.
- Decode: B local-prefill Decode calls at once per (batch size, context length); each token's time_ms after
  the first is the step that made it, and batch_size says how many sequences that step ran. The median of the
  steps that ran all B is the point.

Every call's prompt is its own (`prompt_ids`), so the worker's prefix cache finds none of it: a prefill is
timed at all its tokens, and a decode batch holds a block per position as distinct requests would.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kv_transfer.sink import KvSink
from kv_transfer.tcp_transport import TcpKvReceiver
from kv_transfer.transfer_tokens import KvTransferTokens
from kv_transfer.wire import KV_LAYOUT_VERSION
from planner.profile import (
    DecodeCosts,
    DecodePoint,
    PrefillCosts,
    PrefillPoint,
    WorkerProfile,
)
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.simulated.kv import VerifyOnlyKvAssembler

Progress = Callable[[int, int, str], None]  # (done, total, what was just measured)
STEPS_SKIPPED = 2  # a batch's first steps overlap its sequences' local prefills and joins


class ProfileFailed(RuntimeError):
    """The worker could not be measured (unreachable, refused a call, or never ran a whole batch)."""


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure: prompt lengths (prefill), batch sizes and context lengths (decode), repeats."""

    prompt_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context_tokens: tuple[int, ...] = (64, 512)
    repeats: int = 3  # Prefill calls per prompt length
    decode_steps: int = 12  # tokens per sequence in a decode measurement
    kv_host: str = "127.0.0.1"  # where the prefill worker can reach this process's KV receiver


SALT_DIGITS = 4  # a prompt's leading tokens that spell its salt, base 100


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    """Token ids any vocabulary holds (small, not 0, which is often padding). The first SALT_DIGITS spell `salt`,
    so prompts of different salts share no KV block: a worker's prefix cache finds nothing of one in another."""
    head = [1 + salt // 100**k % 100 for k in range(SALT_DIGITS)]
    return (head + [1 + i % 100 for i in range(length)])[:length]


def new_salts() -> itertools.count:
    """Salts for one measurement's prompts, from a random start: a worker profiled before keeps its earlier
    prompts cached, and must not find them again."""
    return itertools.count(random.randrange(100**SALT_DIGITS))


async def profile_worker(address: str, role: str, settings: ProfileSettings, progress: Progress,
                         metadata=None) -> WorkerProfile:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        try:
            health = await stub.Health(pb.HealthRequest(), timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise ProfileFailed(f"worker {address} did not answer Health: {exc.code().name}: {exc.details()}") from None
        if health.role and health.role != role:
            raise ProfileFailed(f"worker {address} is a {health.role} worker, not {role}")
        common = {"role": role, "worker": address, "model": health.model,
                  "kv_capacity_tokens": health.kv_capacity_tokens}
        try:
            if role == "prefill":
                return WorkerProfile(**common, prefill=await _profile_prefill(stub, settings, progress, metadata))
            return WorkerProfile(**common, decode=await _profile_decode(stub, health, settings, progress, metadata))
        except grpc.aio.AioRpcError as exc:
            raise ProfileFailed(f"worker {address}: {exc.code().name}: {exc.details()}") from None


async def _profile_prefill(stub, settings: ProfileSettings, progress: Progress, metadata) -> PrefillCosts:
    tokens = KvTransferTokens()
    salts = new_salts()
    failures: list[str] = []
    sink = KvSink(on_kv=lambda kv: None, on_failure=lambda request_id, message: failures.append(message),
                  tokens=tokens, assembler=VerifyOnlyKvAssembler)
    receiver = TcpKvReceiver(sink)
    port = await receiver.start(settings.kv_host)
    kv_address = f"{settings.kv_host}:{port}"
    try:
        async def prefill(length: int) -> PrefillPoint:
            request_id = f"profile-{uuid.uuid4().hex}"
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await stub.Prefill(pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt_ids(length, next(salts)),
                sampling=pb.SamplingParams(max_tokens=1, top_p=1), decode_address=kv_address,
                kv_data_address=kv_address, kv_transfer_token=tokens.issue(request_id),
                kv_layout_version=KV_LAYOUT_VERSION), timeout=120, metadata=metadata)
            call_ms = (loop.time() - started) * 1000
            if failures:
                raise ProfileFailed(f"the KV stream of a {length}-token prompt was rejected: {failures[-1]}")
            return PrefillPoint(prompt_tokens=length, prefill_ms=reply.prefill_time_ms,
                                handoff_ms=max(0.0, call_ms - reply.prefill_time_ms), kv_bytes=reply.kv_bytes)

        await prefill(settings.prompt_tokens[0])  # warm-up (a real model's first forward), not kept
        points = []
        total = len(settings.prompt_tokens) * settings.repeats
        for length in settings.prompt_tokens:
            for _ in range(settings.repeats):
                points.append(await prefill(length))
                progress(len(points), total, f"prefill of {length} tokens: {points[-1].prefill_ms:.1f} ms")
        return PrefillCosts.fit(points)
    finally:
        await receiver.stop()


async def _profile_decode(stub, health: pb.HealthResponse, settings: ProfileSettings, progress: Progress,
                          metadata) -> DecodeCosts:
    grid = [(b, c) for c in settings.context_tokens for b in settings.batch_sizes]
    points = []
    salts = new_salts()
    for done, (batch_size, context) in enumerate(grid, 1):
        needed = batch_size * (context + settings.decode_steps)
        if health.kv_capacity_tokens and needed > health.kv_capacity_tokens:
            progress(done, len(grid), f"skipped batch {batch_size} x {context} tokens: over the KV budget "
                                      f"({needed} > {health.kv_capacity_tokens})")
            continue
        steps = await _batch_steps(stub, batch_size, context, settings.decode_steps, metadata, salts)
        if not steps:
            raise ProfileFailed(f"no decode step ran all {batch_size} sequences together (is --max-running "
                                f"below {batch_size}? profile with --batch-sizes up to it)")
        step_ms = statistics.median(steps)
        # Context at the median step: the prompts plus about half of the steps' tokens each.
        points.append(DecodePoint(batch_size=batch_size, step_ms=step_ms,
                                  context_tokens=batch_size * (context + settings.decode_steps // 2)))
        progress(done, len(grid), f"decode batch {batch_size} at {context} context tokens: {step_ms:.1f} ms/step")
    if not points:
        raise ProfileFailed("no decode measurement fits the worker's KV budget: use smaller --batch-sizes or "
                            "--context-tokens")
    return DecodeCosts.fit(points)


async def _batch_steps(stub, batch_size: int, context: int, steps: int, metadata,
                       salts: itertools.count) -> list[float]:
    """time_ms of every token made by a step of the whole batch, past the first STEPS_SKIPPED (the sequences share
    no prompt block, as distinct requests would not)."""
    calls = [stub.Decode(pb.DecodeRequest(
        request_id=f"profile-{uuid.uuid4().hex}", prompt_len=context, prompt_token_ids=prompt_ids(context, next(salts)),
        local_prefill=True, max_seq_len=context + steps + 1,
        sampling=pb.SamplingParams(max_tokens=steps + 1, top_p=1, ignore_eos=True)), timeout=300, metadata=metadata)
        for _ in range(batch_size)]

    async def read(call) -> list[pb.TokenEvent]:
        return [event.token async for event in call if event.HasField("token")]

    streams = await asyncio.gather(*(read(call) for call in calls))
    return [t.time_ms for tokens in streams for t in tokens
            if t.index > STEPS_SKIPPED and t.batch_size == batch_size]
