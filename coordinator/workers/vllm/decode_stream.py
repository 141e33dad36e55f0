"""VllmDecodeStream: a decode on a vLLM instance, read as a pdserve DecodeStream is (client.py's handshake, step 3).

Its answer's server-sent events are split in the connection's callback as they arrive (http1.py), each chunk made
tokens (completions.ChunkReader: pb.TokenEvent's fields) and pushed to a TokenSink: handed straight to the
attempt's listener once `deliver_directly` asked for that (no task wakes per token), queued for `read` otherwise
(the first token, the last, a slow client's). One timer per stream holds its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson

from coordinator.requests.failures import WorkerCallError
from coordinator.requests.request import GenerationRequest
from coordinator.workers.client import DecodeAccepted
from coordinator.workers.token_channels import TokenSink
from coordinator.workers.vllm.call_failures import call_failure, failure, status_error
from coordinator.workers.vllm.completions import ChunkReader, EngineError, PlainToken, UnsupportedOnVllm
from coordinator.workers.vllm.http1 import AnswerReader, HttpConnection, StaleConnection
from proto import worker_pb2 as pb

ACCEPTED = DecodeAccepted("")
DONE = b"data: [DONE]"
# The first event of a stream repeats the prompt's ids (return_token_ids): some 20k tokens take ~128 KiB.
MAX_EVENT_BYTES = 64 << 20


class VllmDecodeStream(AnswerReader):
    """DecodeAccepted, then the tokens one by one (each a pb.TokenEvent, or a PlainToken with its fields; the last
    with its finish reason), then None; a failure as the WorkerCallError a pdserve worker's would be."""

    def __init__(self, client, address: str, request: GenerationRequest, body: dict | None,
                 refusal: UnsupportedOnVllm | None, timeout: float, handoff: asyncio.Future | None,
                 traceparent: str):
        self.address = address
        self._client = client  # its VllmClient
        self._request_id = request.request_id
        self._body = body
        self._refusal = refusal
        self._handoff = handoff
        self._traceparent = traceparent
        self._accepted = self._sent = False
        self._sink = TokenSink()
        self._chunks = ChunkReader(request.sampling.logprobs)
        self._connection: HttpConnection | None = None
        self._head: asyncio.Future | None = None  # the answer's status, while `_send` waits for it
        self._status = 0
        self._buffer = b""
        self._error_pieces: list[bytes] = []
        self._owes_flush = False  # the listener took tokens of this read: flush once it is handed out
        self._last = 0.0
        self._finished = False  # its final token, its end or a failure came: nothing more is wanted from the answer
        self._final_seen = False  # its final token came: the answer's end is moments behind
        self._end_pushed = False  # `read` will return None once the tokens before it are read
        self._ended = False
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + max(timeout, 0.0)
        self._timer = loop.call_at(self._deadline, self._expire)

    async def read(self) -> DecodeAccepted | pb.TokenEvent | PlainToken | None:
        if not self._accepted:
            self._accepted = True
            return ACCEPTED
        try:
            if not self._sent:
                self._sent = True
                await self._send()
            return await self._sink.next()
        except WorkerCallError:  # the connection, the deadline, the loss, or the prefill it waited on
            self.cancel()
            raise

    async def _send(self) -> None:
        if self._refusal is not None:
            raise failure("decode", self.address, "INVALID_ARGUMENT", str(self._refusal))
        body = self._body
        if self._handoff is not None:
            try:
                body["kv_transfer_params"] = await self._handoff
            except Exception as exc:  # noqa: BLE001 - the prefill's own failure, or this stream's end
                raise call_failure("decode", self.address, exc) from None
        client = self._client
        request = client.request_bytes("POST", self.address, "/v1/completions", orjson.dumps(body),
                                       self._traceparent)
        self._last = time.monotonic()
        for tries_left in (1, 0):
            head = self._head = asyncio.get_running_loop().create_future()
            try:
                self._connection = await client.pool.send(self.address, request, self, self._deadline)
                status = await head
            except StaleConnection as exc:
                if tries_left:
                    continue
                raise call_failure("decode", self.address, exc) from None
            except Exception as exc:  # noqa: BLE001 - a connection's failure (or the handoff's), as a worker's
                raise call_failure("decode", self.address, exc) from None
            finally:
                self._head = None
                if head.done() and not head.cancelled():
                    head.exception()  # failed while the dial was under way: what was raised says it
            if status != 200:
                raise status_error("decode", self.address, status,
                                   b"".join(self._error_pieces).decode(errors="replace"))
            return

    # The answer, from the connection's callbacks (http1.AnswerReader)
    def head(self, status: int) -> None:
        self._status = status
        if status == 200 and self._head is not None and not self._head.done():
            self._head.set_result(status)  # an error's text is read to the end first

    def body(self, piece: bytes) -> None:
        if self._status != 200:
            self._error_pieces.append(piece)
            return
        buffer = self._buffer + piece if self._buffer else piece
        start = 0
        while not self._finished:
            # One event per blank line (vLLM ends each event with one), parsed as it completes.
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            event = buffer[start:end].strip()
            start = end + 2
            if event.startswith(b"data:"):
                self._event(event)
        self._buffer = buffer[start:] if not self._finished else b""
        if len(self._buffer) > MAX_EVENT_BYTES:
            self._break(failure("decode", self.address, "INTERNAL", f"an event vLLM streamed is over "
                                f"{MAX_EVENT_BYTES} bytes"))

    def _event(self, event: bytes) -> None:
        if event == DONE:
            self._push_end()
            return
        now = time.monotonic()
        try:
            tokens = self._chunks.events(orjson.loads(event[5:]), (now - self._last) * 1000)
        except EngineError as exc:
            # A request fault (a grammar vLLM refused) is the client's 400; anything else, mid-stream after a
            # transfer, is read as a KV cache that did not arrive (ABORTED: KV_NOT_RECEIVED), as its commonest
            # cause is: another prefill instance is tried.
            code = "INVALID_ARGUMENT" if exc.status in (400, 422) else "ABORTED"
            self._break(failure("decode", self.address, code, f"vLLM failed the request: {exc}"))
            return
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            self._break(failure("decode", self.address, "INTERNAL", f"an event vLLM streamed is not a completion "
                                f"chunk: {exc}"))
            return
        if tokens:
            self._last = now
        sink = self._sink
        for token in tokens:
            if sink.push(token):
                self._owes_flush = True
            if token.finish_reason:
                self._finished = self._final_seen = True

    def _push_end(self) -> None:
        if not self._end_pushed:
            self._end_pushed = self._finished = True
            self._sink.push(None)

    def end(self) -> None:
        if self._status != 200:
            if self._head is not None and not self._head.done():
                self._head.set_result(self._status)
            return
        self._push_end()  # without [DONE] or a final token, maybe inside an event: read as a stream cut short
        if self._ended:
            self._timer.cancel()

    def fail(self, error: Exception) -> None:
        """The answer will not come to its end: whatever waits on this stream fails with `error`."""
        if isinstance(error, StaleConnection) and self._head is not None and not self._head.done():
            self._head.set_exception(error)  # nothing reached vLLM: `_send` sends it again, the stream goes on
            return
        lost = call_failure("decode", self.address, error)
        if self._head is not None and not self._head.done():
            self._head.set_exception(lost)
        if self._handoff is not None and not self._handoff.done():
            self._handoff.set_exception(lost)
        self._sink.lose(lost)
        self._finished = True

    def after_read(self) -> None:
        if self._owes_flush:
            self._owes_flush = False
            self._sink.flush_direct()

    def _break(self, error: WorkerCallError) -> None:
        """The answer is unusable: close its connection and fail what waits on it."""
        self._finished = True
        if self._connection is not None and self._connection.reader is self:
            self._connection.abandon(error)
        else:
            self.fail(error)

    def _expire(self) -> None:
        self._break(call_failure("decode", self.address, TimeoutError()))

    def deliver_directly(self, take: Callable[[pb.TokenEvent], bool], flush: Callable[[], None]) -> None:
        """Offer each token to `take` inside the connection's callback as it is parsed (TokenSink.deliver_tokens)."""
        self._sink.deliver_tokens(take, flush, routed=False)

    def cancel(self) -> None:
        """Once: close the connection unless its answer ends on its own (vLLM aborts a request whose client left)
        and forget the handoff."""
        if self._ended:
            return
        self._ended = True
        self._sink.direct = self._sink.flush = None
        self._client.stream_ended(self)
        self._client._handoffs.pop(self._request_id, None)
        if self._handoff is not None:
            if not self._handoff.done():
                self._handoff.cancel()
            elif not self._handoff.cancelled():
                self._handoff.exception()  # a failed prefill's, reported by the attempt: read here, not logged
        connection = self._connection
        if connection is not None and connection.reader is self:
            if self._final_seen:
                return  # its [DONE] is moments behind: the connection goes back to the pool then (or the timer
                # closes it at the deadline)
            connection.abandon(ConnectionAbortedError("the stream was left"))
        self._timer.cancel()
