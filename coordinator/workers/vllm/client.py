"""VllmClient: the coordinator's calls to vLLM instances over their OpenAI HTTP API, with WorkerClient's methods
and results, so routing, retries, migration, limits and metrics run unchanged over a vLLM fleet.

One attempt on a vLLM prefill + decode pair (the AttemptRunner's order, mapped onto vLLM's handshake):
  1. `open_decode`: the stream is accepted at once (vLLM admits on arrival; it queues what it cannot run).
  2. `prefill`: the prompt on the prefill instance (completions.py, step 1); its `kv_transfer_params` are handed
     to the decode stream of the same request id.
  3. The decode stream's next read sends the request with them to the decode instance and relays its chunks
     as pb.TokenEvents. Without a prefill instance (a short prompt, local prefill) it sends the request alone.
Failures are WorkerCallErrors with the gRPC code a pdserve worker's failure would carry (failures.py then
classifies them): no connection or a reset is UNAVAILABLE, a 400 INVALID_ARGUMENT, a 5xx INTERNAL, the
request's deadline DEADLINE_EXCEEDED. An instance declared lost (`lose`) fails its calls in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from coordinator.requests.failures import CALL_DEADLINE_DETAILS, WorkerCallError, WorkerFailure
from coordinator.requests.request import GenerationRequest
from coordinator.workers.vllm.completions import (ChunkReader, EngineError, UnsupportedOnVllm, completion_body,
                                          prefill_body)
from coordinator.workers.vllm.load import health_report
from coordinator.workers.client import DecodeAccepted, HealthReport, PrefillResult
from proto import worker_pb2 as pb
from security.secrets import SecretFile
from security.tls import LinkTls

ACCEPTED = DecodeAccepted("")
DONE = b"data: [DONE]"
# The first event of a stream repeats the prompt's ids (return_token_ids): aiohttp's default bound (128 KiB) would
# fail a prompt of some 20k tokens.
MAX_EVENT_BYTES = 64 << 20
# /metrics is ~80 KB per instance: read for the load at most this often; a probe in between (the silence
# watch's) asks /health alone and keeps the last load.
METRICS_MAX_AGE_S = 1.0


def _failure(stage: str, address: str, code: str, details: str, reason: int = 0) -> WorkerCallError:
    return WorkerCallError(WorkerFailure(stage, address, code, details, reason))


def _status_error(stage: str, address: str, status: int, text: str) -> WorkerCallError:
    """A vLLM error answer as the failure a pdserve worker's status would be."""
    try:
        message = json.loads(text).get("error", {}).get("message") or text
    except (ValueError, AttributeError):
        message = text
    message = f"HTTP {status}: {message[:500]}"
    if status == 400 or status == 422:
        return _failure(stage, address, "INVALID_ARGUMENT", message)
    if status in (429, 503):  # overloaded or shutting down: another instance may take it
        return _failure(stage, address, "UNAVAILABLE", message)
    return _failure(stage, address, "INTERNAL", message)


class _InFlight:
    """Calls in flight per instance, so a lost instance's calls fail at once (their tasks cancelled, the
    cancellation then read as that loss, as asyncio.timeout reads its own)."""

    def __init__(self):
        self._calls: dict[str, dict[asyncio.Task, list[str]]] = {}

    def enter(self, address: str) -> list[str]:
        task = asyncio.current_task()
        lost: list[str] = []
        self._calls.setdefault(address, {})[task] = lost
        return lost

    def leave(self, address: str) -> None:
        calls = self._calls.get(address)
        if calls is not None:
            calls.pop(asyncio.current_task(), None)
            if not calls:
                del self._calls[address]

    def lose(self, address: str, reason: str) -> None:
        for task, lost in self._calls.pop(address, {}).items():
            lost.append(reason)
            task.cancel()


class _Call:
    """One call to an instance, as `async with`: bounded by `timeout_s`, failed at once when the instance is declared
    lost, and aiohttp's failures, the deadline and the loss raised as the WorkerCallError a pdserve worker's would
    be. Anything else raised inside goes through untouched."""

    __slots__ = ("_in_flight", "_stage", "_address", "_timeout_s", "_timeout", "_lost")

    def __init__(self, in_flight: _InFlight, stage: str, address: str, timeout_s: float):
        self._in_flight, self._stage, self._address, self._timeout_s = in_flight, stage, address, timeout_s

    async def __aenter__(self) -> None:
        self._lost = self._in_flight.enter(self._address)
        self._timeout = asyncio.timeout(max(self._timeout_s, 0.0))
        await self._timeout.__aenter__()

    async def __aexit__(self, kind, exc, tb) -> bool:
        stage, address = self._stage, self._address
        try:
            try:
                await self._timeout.__aexit__(kind, exc, tb)
            except TimeoutError:
                raise _failure(stage, address, "DEADLINE_EXCEEDED", CALL_DEADLINE_DETAILS,
                               pb.FAILURE_REASON_CALL_DEADLINE) from None
            if isinstance(exc, aiohttp.ClientError):  # a connect timeout is one too: the host is gone, not the time
                raise _failure(stage, address, "UNAVAILABLE", f"{type(exc).__name__}: {exc}") from None
            if isinstance(exc, asyncio.CancelledError) and (error := _lost_instead(self._lost, stage, address)):
                raise error from None
            return False
        finally:
            self._in_flight.leave(address)


class VllmClient:
    """HTTP calls to vLLM instances (base URL by address), https with the worker link's TLS, the worker secret as
    the API key; the same calls and results as WorkerClient (module docstring)."""

    def __init__(self, urls: dict[str, str], tls: LinkTls | None = None, secret: SecretFile | None = None):
        self.urls = urls
        self._tls = tls
        self._secret = secret
        self._session: aiohttp.ClientSession | None = None
        self._handoffs: dict[str, asyncio.Future] = {}  # request id -> the prefill's kv_transfer_params
        self._in_flight = _InFlight()
        self._loads: dict[str, tuple[float, HealthReport]] = {}  # address -> (when read, the load it gave)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool limit: every stream holds a connection for its whole life.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    def _headers(self, traceparent: str = "") -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._secret is not None:
            headers["Authorization"] = f"Bearer {self._secret.value}"
        if traceparent:
            headers["traceparent"] = traceparent
        return headers

    def _ssl(self):
        return self._tls.ssl_context() if self._tls is not None else None

    def _url(self, address: str, path: str) -> str:
        return self.urls[address] + path

    def open_decode(self, address: str, request: GenerationRequest, max_tokens: int, max_seq_len: int,
                    timeout: float, local_prefill: bool = False, traceparent: str = "",
                    sampling: pb.SamplingParams | None = None) -> VllmDecodeStream:
        """A decode on the vLLM instance at `address`: without `local_prefill`, it waits for the prefill of the
        same request id to hand it the KV blocks' whereabouts (module docstring)."""
        handoff = None
        if not local_prefill:
            handoff = self._handoffs[request.request_id] = asyncio.get_running_loop().create_future()
        return VllmDecodeStream(self, address, request, max_tokens, timeout, handoff, traceparent)

    async def prefill(self, address: str, request: GenerationRequest, max_tokens: int, decode_address: str,
                      timeout: float, kv_data_address: str = "", kv_transfer_token: str = "", traceparent: str = "",
                      decode_cached_tokens: int = 0, sampling: pb.SamplingParams | None = None,
                      kv_layout_version: int = 0) -> PrefillResult:
        """Step 1 of the handshake on the prefill instance; its kv_transfer_params go to the decode stream (vLLM's
        NIXL connector agrees on its own KV layout: `kv_layout_version` is not used)."""
        handoff = self._handoffs.pop(request.request_id, None)
        started = time.monotonic()
        try:
            try:
                body = prefill_body(completion_body(request, max_tokens, request.request_id))
            except UnsupportedOnVllm as exc:
                raise _failure("prefill", address, "INVALID_ARGUMENT", str(exc)) from None
            answer = await self._post_json("prefill", address, "/v1/completions", body, timeout, traceparent)
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise _failure("prefill", address, "INTERNAL", "the answer carries no kv_transfer_params: is the "
                               "instance started with a NixlConnector kv_role kv_producer?")
            token_ids = (answer.get("choices") or [{}])[0].get("token_ids") or [0]
        except asyncio.CancelledError:
            if handoff is not None:
                handoff.cancel()
            raise
        except Exception as exc:
            if handoff is not None and not handoff.done():
                # The decode stream waiting on it fails with it; the attempt then reports the prefill's failure.
                handoff.set_exception(exc)
            raise
        elapsed_ms = (time.monotonic() - started) * 1000
        if handoff is not None and not handoff.done():
            handoff.set_result(params)
        return PrefillResult(token_ids[0], elapsed_ms, kv_bytes=0, kv_transfer_ms=0.0, forward_ms=elapsed_ms)

    def _call(self, stage: str, address: str, timeout_s: float) -> _Call:
        return _Call(self._in_flight, stage, address, timeout_s)

    async def _post_json(self, stage: str, address: str, path: str, body: dict, timeout: float,
                         traceparent: str) -> dict:
        async with self._call(stage, address, timeout):
            async with self._http().post(self._url(address, path), data=orjson.dumps(body), ssl=self._ssl(),
                                         headers=self._headers(traceparent)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise _status_error(stage, address, resp.status, raw.decode(errors="replace"))
                return orjson.loads(raw)

    async def update_adapters(self, path: str, body: dict, timeout: float = 60.0) -> None:
        """POST vLLM's /v1/load_lora_adapter or /v1/unload_lora_adapter (`path`) with `body` to every instance;
        WorkerCallError naming the first that refuses."""
        for address in self.urls:
            async with self._call("adapter", address, timeout):
                async with self._http().post(self._url(address, path), data=orjson.dumps(body), ssl=self._ssl(),
                                             headers=self._headers()) as resp:
                    if resp.status != 200:
                        raise _status_error("adapter", address, resp.status, await resp.text())

    async def health(self, address: str, role: str, timeout: float = 2.0) -> HealthReport:
        """vLLM's /health for liveness, its /metrics for the load (load.py; at most every METRICS_MAX_AGE_S)."""
        http, ssl, headers = self._http(), self._ssl(), self._headers()
        async with self._call(role, address, timeout):
            async with http.get(self._url(address, "/health"), ssl=ssl, headers=headers) as resp:
                if resp.status != 200:
                    raise _status_error(role, address, resp.status, await resp.text())
            known = self._loads.get(address)
            if known is not None and time.monotonic() - known[0] < METRICS_MAX_AGE_S:
                return known[1]
            async with http.get(self._url(address, "/metrics"), ssl=ssl, headers=headers) as resp:
                if resp.status != 200:
                    raise _status_error(role, address, resp.status, await resp.text())
                report = health_report(await resp.text())
            self._loads[address] = (time.monotonic(), report)
            return report

    async def lose(self, address: str, reason: str) -> None:
        """The instance at `address` was declared lost: its calls in flight fail as UNAVAILABLE with `reason`."""
        self._in_flight.lose(address, reason)

    async def forget(self, address: str) -> None:
        """Forget its last load (connections are pooled per host by the session: nothing to close)."""
        self._loads.pop(address, None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _lost_instead(lost: list[str], stage: str, address: str) -> WorkerCallError | None:
    """What a call cancelled while in flight ends with: its instance's loss, or None when the cancellation is its
    own task's (to be raised on)."""
    task = asyncio.current_task()
    if lost and task is not None and task.uncancel() == 0:
        return _failure(stage, address, "UNAVAILABLE", lost[0])
    return None


class VllmDecodeStream:
    """A decode on a vLLM instance, read as a pdserve DecodeStream: DecodeAccepted, then one pb.TokenEvent per
    token (the last with its finish reason), then None."""

    def __init__(self, client: VllmClient, address: str, request: GenerationRequest, max_tokens: int,
                 timeout: float, handoff: asyncio.Future | None, traceparent: str):
        self.address = address
        self._client = client
        self._request = request
        self._max_tokens = max_tokens
        self._deadline = time.monotonic() + timeout
        self._handoff = handoff
        self._traceparent = traceparent
        self._accepted = False
        self._response: aiohttp.ClientResponse | None = None
        self._pending: list[pb.TokenEvent] = []
        self._reader = ChunkReader(request.sampling.logprobs)
        self._last = 0.0
        self._ended = False

    async def read(self) -> DecodeAccepted | pb.TokenEvent | None:
        if not self._accepted:
            self._accepted = True
            return ACCEPTED
        if self._pending:
            return self._pending.pop(0)
        if self._ended:
            return None
        try:
            async with self._client._call("decode", self.address, self._deadline - time.monotonic()):
                if self._response is None:
                    await self._send()
                return await self._next_event()
        except WorkerCallError:  # the connection, the deadline, the loss, or the prefill it waited on
            self.cancel()
            raise
        except UnsupportedOnVllm as exc:
            raise _failure("decode", self.address, "INVALID_ARGUMENT", str(exc)) from None
        except EngineError as exc:
            self.cancel()
            # A request fault (a grammar vLLM refused) is the client's 400; anything else, mid-stream after a
            # transfer, is read as a KV cache that did not arrive (ABORTED: KV_NOT_RECEIVED), as its commonest
            # cause is: another prefill instance is tried.
            code = "INVALID_ARGUMENT" if exc.status in (400, 422) else "ABORTED"
            raise _failure("decode", self.address, code, f"vLLM failed the request: {exc}") from None
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, HttpProcessingError) as exc:
            self.cancel()
            raise _failure("decode", self.address, "INTERNAL", f"an event vLLM streamed is not a completion "
                           f"chunk: {exc}") from None

    async def _send(self) -> None:
        body = completion_body(self._request, self._max_tokens, self._request.request_id)
        if self._handoff is not None:
            body["kv_transfer_params"] = await self._handoff
        client = self._client
        self._last = time.monotonic()
        response = await client._http().post(client._url(self.address, "/v1/completions"), data=orjson.dumps(body),
                                             ssl=client._ssl(), headers=client._headers(self._traceparent))
        if response.status != 200:
            try:
                text = await response.text()
            finally:
                response.close()  # on every path: a deadline or a loss may interrupt the read
            raise _status_error("decode", self.address, response.status, text)
        self._response = response

    async def _next_event(self) -> pb.TokenEvent | None:
        content = self._response.content
        while True:
            # One read per server-sent event (vLLM ends each with a blank line), not one per line.
            event = await content.readuntil(b"\n\n", max_size=MAX_EVENT_BYTES)
            if not event.endswith(b"\n\n"):  # the connection ended without [DONE], maybe inside an event
                self._ended = True
                return None
            event = event.strip()
            if not event.startswith(b"data:"):
                continue
            if event == DONE:
                self._ended = True
                return None
            now = time.monotonic()
            events = self._reader.events(orjson.loads(event[5:]), (now - self._last) * 1000)
            if events:
                self._last = now
                self._pending.extend(events[1:])
                return events[0]

    def deliver_directly(self, accepts: Callable[[], bool], take: Callable[[pb.TokenEvent], None],
                         flush: Callable[[], None]) -> None:
        """Nothing to do: an HTTP stream's tokens come only through `read`."""

    def cancel(self) -> None:
        """Close the connection (vLLM aborts a request whose client left) and forget the handoff."""
        self._ended = True
        self._client._handoffs.pop(self._request.request_id, None)
        if self._handoff is not None:
            if not self._handoff.done():
                self._handoff.cancel()
            elif not self._handoff.cancelled():
                self._handoff.exception()  # a failed prefill's, reported by the attempt: read here, not logged
        if self._response is not None:
            self._response.close()
