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


@dataclass
class TransferredKv:
    """A prompt's KV cache as it travels: per layer (key, value), plus the prefill result."""

    request_id: str
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    first_token_id: int
    prefill_time_ms: float
    # (logprob, ((token_id, logprob), ...)) of the first token, when the request asked for logprobs.
    first_logprobs: tuple | None = None
    # The decode worker's one-time token for this request (kv_transfer/transfer_tokens.py), sent in the header.
    transfer_token: str = field(default="", repr=False)
    # Set by a receiver that lent the tensors' memory; call `release` once they have been copied.
    on_release: Callable[[], None] | None = field(default=None, repr=False)
    receipt: KvReceipt | None = None  # set by the sink that received it; None when made on this worker
    first_position: int = 0  # the layers hold positions [first_position, first_position + seq_len)
    prompt_logprobs: Any = None  # the trailer's pb.PromptLogprobs (prompt tokens 1 .. n-1), relayed with the first token

    def release(self) -> None:
        """Give the tensors' memory back to whoever lent it; the tensors must not be used after."""
        if self.on_release is not None:
            callback, self.on_release = self.on_release, None
            callback()

    @property
    def seq_len(self) -> int:
        return self.layers[0][0].shape[2]

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)
