"""The KV transfer contract: what travels, and how a transfer can fail."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the simulated worker imports this module without torch
    import torch


class KvTransferError(Exception):
    """A KV stream that cannot be trusted: corrupt, truncated, malformed or late."""


class KvStreamRefused(KvTransferError):
    """A KV stream without the request's one-time transfer token: from someone the decode worker did not
    ask, so it says nothing about the request it names, which carries on."""


@dataclass(frozen=True)
class KvReceipt:
    """How a KV cache reached the decode worker: over which transport, its bytes, and the time from its header
    to its last block (the receiving end's measure of the transfer)."""

    transport: str  # "tcp" (the raw-TCP data port) or "grpc" (the KvReceiver stream)
    num_bytes: int
    receive_ms: float


class KvLanding:
    """Blocks of a decode worker's pool that a KV stream is received straight into: their ids in position order, and
    per tensor (index 2 * layer + is_value) the writable runs of memory their bytes are, in the wire's layout.

    Until the engine takes them (`take`) they belong to the transfer: `release` gives them back (`give_back`, once)
    when it fails, is refused or its request is gone."""

    def __init__(self, block_ids: list[int], num_positions: int, runs: list[list[memoryview]],
                 give_back: Callable[[list[int]], None]):
        self.block_ids = block_ids
        self.num_positions = num_positions
        self.runs = runs
        self._give_back: Callable[[list[int]], None] | None = give_back

    def take(self) -> list[int]:
        """The blocks, now the caller's (nothing is given back after this)."""
        self._give_back = None
        return self.block_ids

    def release(self) -> None:
        """Give the blocks back unless they were taken (or given back) already."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self.block_ids)


@dataclass
class TransferredKv:
    """A prompt's KV cache as it travels: per layer (key, value), each [positions, kv_heads, head_dim], plus the
    prefill result. A cache received straight into a decode worker's pool has no tensors: `landed` names its blocks."""

    request_id: str
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    first_token_id: int
    prefill_time_ms: float
    # (logprob, ((token_id, logprob), ...)) of the first token, when the request asked for logprobs.
    first_logprobs: tuple | None = None
    # The decode worker's one-time token for this request (kv_transfer/transfer_tokens.py), sent in the header.
    transfer_token: str = field(default="", repr=False)
    # Set by a receiver that lent the tensors' memory (or the pool blocks it landed in); call `release` once they
    # have been copied (or taken).
    on_release: Callable[[], None] | None = field(default=None, repr=False)
    receipt: KvReceipt | None = None  # set by the sink that received it; None when made on this worker
    first_position: int = 0  # the layers hold positions [first_position, first_position + seq_len)
    prompt_logprobs: Any = None  # the trailer's pb.PromptLogprobs (prompt tokens 1 .. n-1), relayed with the first token
    landed: KvLanding | None = field(default=None, repr=False)  # set: already in these pool blocks (`layers` is [])

    def release(self) -> None:
        """Give the tensors' memory back to whoever lent it; the tensors must not be used after."""
        if self.on_release is not None:
            callback, self.on_release = self.on_release, None
            callback()

    @property
    def seq_len(self) -> int:
        return self.landed.num_positions if self.landed is not None else self.layers[0][0].shape[0]

    @property
    def num_bytes(self) -> int:
        if self.landed is not None:
            return sum(len(run) for runs in self.landed.runs for run in runs)
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)
