"""gRPC calls from the coordinator to workers; the only place coordinator types meet protobuf."""

from __future__ import annotations

import grpc

from coordinator.request import FinishReason, GenerationRequest
from kv_transfer.grpc_transport import GRPC_OPTIONS
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc

FINISH_FROM_PB = {
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
}


def sampling_to_pb(request: GenerationRequest, max_tokens: int) -> pb.SamplingParams:
    s = request.sampling
    return pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed or 0,
        has_seed=s.seed is not None,
        max_tokens=max_tokens,
        stop=list(s.stop),
        skip_special_tokens=s.skip_special_tokens,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        return_logprobs=s.logprobs is not None,
        top_logprobs=s.logprobs or 0,
    )


class WorkerClient:
    """One channel per worker address, opened on first use and closed at shutdown."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    def open_decode(self, address: str, request: GenerationRequest, max_tokens: int, max_seq_len: int, timeout: float,
                    local_prefill: bool = False):
        """Start a Decode stream (with `local_prefill`, the decode worker prefills the prompt itself);
        the caller reads events from the returned call."""
        stub = pb_grpc.DecodeServiceStub(self._channel(address))
        send_prompt = local_prefill or request.sampling.repetition_penalty != 1.0
        return stub.Decode(
            pb.DecodeRequest(
                request_id=request.request_id,
                prompt_len=len(request.prompt_token_ids),
                sampling=sampling_to_pb(request, max_tokens),
                max_seq_len=max_seq_len,
                prompt_token_ids=request.prompt_token_ids if send_prompt else [],
                local_prefill=local_prefill,
            ),
            timeout=timeout,
        )

    async def prefill(
        self, address: str, request: GenerationRequest, max_tokens: int, decode_address: str, timeout: float,
        kv_data_address: str = "",
    ) -> pb.PrefillResponse:
        stub = pb_grpc.PrefillServiceStub(self._channel(address))
        return await stub.Prefill(
            pb.PrefillRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=sampling_to_pb(request, max_tokens),
                decode_address=decode_address,
                kv_data_address=kv_data_address,
            ),
            timeout=timeout,
        )

    async def health(self, address: str, role: str, timeout: float = 2.0) -> pb.HealthResponse:
        channel = self._channel(address)
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        return await stub.Health(pb.HealthRequest(), timeout=timeout)

    async def forget(self, address: str) -> None:
        """Close the channel of an instance that left."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
