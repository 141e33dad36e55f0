"""bench/gateway.py's `epp-direct` part, its load generator: Envoy's side of ext_proc v3 (FULL_DUPLEX_STREAMED
request bodies, as Envoy 1.40 speaks it on deploy/envoy/pdserve-gateway.yaml) played against the coordinator's
endpoint picker directly, plus what stands in for the sidecars (announcements) and the coordinator's CPU clock.

One stream per request, as Envoy sends it (coordinator/gateway/ext_proc.py's docstring):
  1. protocol_config (request_body_mode FULL_DUPLEX_STREAMED, response_body_mode NONE) with request_headers
     (:method POST, :path /v1/completions, content-type, content-length; end_of_stream false);
  2. the body in CHUNK-byte request_body messages, the last with end_of_stream true (each written without waiting
     for an answer: the picker answers nothing before the body's end);
  3. read: the request_headers answer (the pick: its destination header), then the echoed body chunks until one
     ends the stream;
  4. the request's life (`hold_s`: a generation on the sidecar), then response_headers (:status 200 and
     x-gateway-destination-endpoint-served: the first picked endpoint) and response_trailers, each answered;
  5. the stream closed (done writing; the server ends it: the pick's lease is released).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from coordinator.gateway.endpoint_pick import DESTINATION_HEADER, SERVED_KEY
from coordinator.gateway.ext_proc import process_call
from proto import ext_proc_pb2 as ep  # Envoy's ext_proc v3 messages, its field numbers (proto/ext_proc.proto)

CHUNK = 64 * 1024  # request body bytes per message (Envoy sends what its buffers hold: 2 messages for 220 KB seen)
CONNECTIONS = 2  # HTTP/2 connections to the picker, streams spread over them (Envoy: one per worker thread)
HOLD_JITTER = 0.5  # each stream's hold is drawn uniformly from hold_s x [1 - this, 1 + this] (generations vary)
STREAM_TIMEOUT_S = 120
ANNOUNCE_EVERY_S = 5.0


@dataclass
class Sample:
    ok: bool
    to_pick_s: float = 0.0  # stream open (its first message written) -> the headers answer (the pick) read
    after_body_s: float = 0.0  # the last body chunk written -> the pick read
    picked_at: float = 0.0  # time.monotonic() of the pick
    error: str = ""


def _header_map(values: dict[str, str]) -> ep.HeaderMap:
    return ep.HeaderMap(headers=[ep.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])


def _set_header(answer: ep.HeadersResponse, key: str) -> str:
    for option in answer.response.header_mutation.set_headers:
        if option.header.key.lower() == key:
            return option.header.raw_value.decode() or option.header.value
    return ""


async def _read(call, what: str) -> ep.ProcessingResponse:
    answer = await call.read()
    if answer is grpc.aio.EOF:
        raise RuntimeError(f"the stream ended before {what}")
    if answer.HasField("immediate_response"):
        r = answer.immediate_response
        raise RuntimeError(f"refused {r.status.code} before {what}: {r.body[:200]!r}")
    return answer


async def one_stream(process, body: bytes, hold_s: float, on_pick: Callable[[], None]) -> Sample:
    """One request's ext_proc stream (`process`: process_call of a channel), as Envoy speaks it (the module's
    docstring); `on_pick` runs at the pick."""
    call = process()
    try:
        first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=_header_map({
            ":method": "POST", ":path": "/v1/completions", ":authority": "gateway", ":scheme": "http",
            "content-type": "application/json", "content-length": str(len(body))}), end_of_stream=False))
        first.protocol_config.request_body_mode = ep.ProcessingMode.FULL_DUPLEX_STREAMED
        first.protocol_config.response_body_mode = ep.ProcessingMode.NONE
        opened = time.monotonic()
        await call.write(first)
        for i in range(0, len(body), CHUNK):
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(
                body=body[i:i + CHUNK], end_of_stream=i + CHUNK >= len(body))))
        sent = time.monotonic()
        answer = await _read(call, "the pick")
        picked = time.monotonic()
        on_pick()
        if not answer.HasField("request_headers"):
            raise RuntimeError(f"a {answer.WhichOneof('response')} answer before the pick")
        destination = _set_header(answer.request_headers, DESTINATION_HEADER)
        if not destination:
            raise RuntimeError("the pick set no destination")
        echoed = 0
        while True:
            answer = await _read(call, "the echoed body's end")
            streamed = answer.request_body.response.body_mutation.streamed_response
            echoed += len(streamed.body)
            if streamed.end_of_stream:
                break
        if echoed != len(body):
            raise RuntimeError(f"{echoed} body bytes echoed of {len(body)}")
        await asyncio.sleep(hold_s)
        await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=_header_map({
            ":status": "200", "content-type": "application/json", SERVED_KEY: destination.split(",")[0]}),
            end_of_stream=False)))
        await _read(call, "the response headers' answer")
        await call.write(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
        await _read(call, "the response trailers' answer")
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
        return Sample(True, picked - opened, picked - sent, picked)
    except (grpc.aio.AioRpcError, RuntimeError) as exc:
        call.cancel()
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        return Sample(False, error=f"{type(exc).__name__}: {str(detail)[:300]}")
    except BaseException:
        call.cancel()
        raise


@dataclass
class Load:
    samples: list[Sample]
    wall_s: float
    warm_at: float | None = None  # monotonic time of the `warm_up`-th pick
    warm_snapshot: object = None  # what `at_warm` returned then


async def closed_loop(epp: str, bodies: list[bytes], requests: int, concurrency: int, hold_s: float, seed: int,
                      warm_up: int, at_warm: Callable[[], object]) -> Load:
    """`requests` streams to the picker at `epp`, `concurrency` open at once (the first wave all at once, then one
    as each ends), body i % len(bodies) each; `at_warm()` runs (in a thread) once `warm_up` picks are in."""
    rng = random.Random(seed)
    holds = [hold_s * rng.uniform(1 - HOLD_JITTER, 1 + HOLD_JITTER) for _ in range(requests)]
    samples: list[Sample | None] = [None] * requests
    todo = iter(range(requests))
    picks = itertools.count(1)
    warm = asyncio.Event()
    load = Load([], 0.0)
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    channels = [grpc.aio.insecure_channel(epp, options=options) for _ in range(CONNECTIONS)]
    try:
        stubs = [process_call(c) for c in channels]
        await asyncio.gather(*(c.channel_ready() for c in channels))

        def on_pick() -> None:
            if next(picks) == warm_up:
                load.warm_at = time.monotonic()
                warm.set()

        async def snapshot() -> None:
            await warm.wait()
            load.warm_snapshot = await asyncio.to_thread(at_warm)

        async def client() -> None:
            for i in todo:
                try:
                    samples[i] = await asyncio.wait_for(
                        one_stream(stubs[i % len(stubs)], bodies[i % len(bodies)], holds[i], on_pick),
                        STREAM_TIMEOUT_S)
                except asyncio.TimeoutError:
                    samples[i] = Sample(False, error=f"TimeoutError: the stream not done in {STREAM_TIMEOUT_S} s")

        watch = asyncio.create_task(snapshot())
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
            load.wall_s = time.monotonic() - t0
            if warm.is_set():
                await watch
        finally:
            watch.cancel()
    finally:
        for c in channels:
            await c.close()
    load.samples = samples
    return load


class Announcer:
    """Stands in for the sidecars: announces `endpoints` (decode worker -> endpoint) to the picker's management API
    now and every ANNOUNCE_EVERY_S until stopped (nothing serves there, so nothing else keeps them live)."""

    def __init__(self, management: str, endpoints: dict[str, str], token: str = ""):
        self.management, self.endpoints, self.token = management, endpoints, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announcer", daemon=True)
        self.failures: list[str] = []

    def announce(self) -> None:
        for decode, endpoint in self.endpoints.items():
            request = urllib.request.Request(
                f"{self.management}/v1/sidecars/announce", method="POST",
                data=json.dumps({"decode": decode, "endpoint": endpoint}).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})
            with urllib.request.urlopen(request, timeout=5) as resp:
                resp.read()

    def start(self) -> None:
        self.announce()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(ANNOUNCE_EVERY_S):
            try:
                self.announce()
            except OSError as exc:
                self.failures.append(str(exc))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """user + system CPU seconds of process `pid` (and its live descendants) so far (/proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, cpu
    total, frontier = 0.0, [pid]
    while frontier:
        p = frontier.pop()
        total += stats.get(p, (0, 0.0))[1]
        frontier += [child for child, (ppid, _) in stats.items() if ppid == p and descendants]
    return total


@dataclass
class Window:
    """The samples of one window of a run, and the picker's figures over it."""

    name: str
    samples: list[Sample]
    span_s: float
    histogram: dict[float, float] = field(default_factory=dict)
    cpu_s: float | None = None
    client_cpu_s: float | None = None  # this load generator's

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def picks_per_s(self) -> float | None:
        return len(self.ok) / self.span_s if self.span_s > 0 else None

    @property
    def cpu_ms_per_pick(self) -> float | None:
        return self.cpu_s / len(self.ok) * 1000 if self.cpu_s is not None and self.ok else None

    @property
    def client_cpu_ms_per_pick(self) -> float | None:
        return self.client_cpu_s / len(self.ok) * 1000 if self.client_cpu_s is not None and self.ok else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile of the raw values, interpolated between the two nearest (exact, no buckets)."""
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def exact_ms(values: list[float]) -> str:
    """p50 / p90 / p99 of `values` (seconds) in ms."""
    quantiles = (percentile(values, q) for q in (0.5, 0.9, 0.99))
    return " / ".join("–" if v is None else f"{v * 1000:.1f}" for v in quantiles)


def _delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def direct_windows(load: Load, before: tuple, after: tuple, warm_up: int) -> list[Window]:
    """The steady window (the picks after the first `warm_up`, in the order they came) and the whole run, each with
    the server's pick histogram, the coordinator's and this process's CPU seconds over it (`before`, `after` and
    load.warm_snapshot: (histogram, coordinator CPU, own CPU) when the run began, ended, and had made `warm_up`
    picks)."""
    whole = Window("whole run", load.samples, load.wall_s, _delta(before[0], after[0]), after[1] - before[1],
                   after[2] - before[2])
    ok = sorted((s for s in load.samples if s.ok), key=lambda s: s.picked_at)
    if load.warm_snapshot is None or len(ok) <= warm_up:
        return [whole]
    steady = ok[warm_up:]
    return [Window(f"steady (after the first {warm_up} picks)", steady, steady[-1].picked_at - load.warm_at,
                   _delta(load.warm_snapshot[0], after[0]), after[1] - load.warm_snapshot[1],
                   after[2] - load.warm_snapshot[2]), whole]
