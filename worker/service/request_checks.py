"""A worker request's parts checked before it is admitted, whatever the servicer: sampling rules, media (images'
embeddings pulled from encode workers), the LoRA adapter."""

from __future__ import annotations

import asyncio
from typing import Any

from proto import worker_pb2 as pb
from proto.sampling import DEFAULT_SAMPLING
from worker.engine.decode_backend import DecodeBackend
from worker.engine.errors import InvalidRequest
from worker.engine.lora import LoadedLora, lora_from_pb, refuse_lora
from worker.engine.media import MediaSpan, spans_from_pb
from worker.engine.prefill_backend import PrefillBackend
from worker.engine.sequence import SamplingParams
from worker.service.embedding_pull import EmbeddingPuller


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or DEFAULT_SAMPLING.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.has_seed else None,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        skip_special_tokens=msg.skip_special_tokens,
        repetition_penalty=msg.repetition_penalty or DEFAULT_SAMPLING.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        return_logprobs=msg.return_logprobs,
        top_logprobs=msg.top_logprobs,
        grammar=msg.guided.grammar if msg.HasField("guided") else None,
        grammar_generated=tuple(msg.guided.generated_token_ids),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        typical_p=msg.typical_p or DEFAULT_SAMPLING.typical_p,
        prompt_logprobs=msg.prompt_top_logprobs if msg.return_prompt_logprobs else None,
    )


MAX_TOP_LOGPROBS = 20  # alternatives per position a request may ask for (worker.proto)


async def checked_sampling(engine: PrefillBackend | DecodeBackend, msg: pb.SamplingParams) -> SamplingParams:
    """The request's sampling rules once its backend accepts them (InvalidRequest otherwise); a grammar is
    compiled on a thread, so neither the event loop nor the engine waits for it."""
    sampling = sampling_from_pb(msg)
    for name, count in (("top_logprobs", sampling.top_logprobs), ("prompt_top_logprobs", sampling.prompt_logprobs)):
        if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"{name}={count} must be in [0, {MAX_TOP_LOGPROBS}]")
    if sampling.grammar is None:
        engine.check_sampling(sampling)
    else:
        await asyncio.to_thread(engine.check_sampling, sampling)
    return sampling


async def checked_media(engine: PrefillBackend | DecodeBackend, items, prompt_len: int, with_data: bool,
                        embeddings: EmbeddingPuller | None = None, request_id: str = ""
                        ) -> tuple[tuple[MediaSpan, ...], Any]:
    """The request's media once its backend takes them (InvalidRequest otherwise), and what it made of them; with
    their data, they are decoded and preprocessed on a thread, and the outputs of those naming an encode worker
    pulled from it first (`embeddings`: a prefill worker's puller; InvalidRequest on a worker without one)."""
    media = spans_from_pb(items, prompt_len, with_data)
    if not (media and with_data):
        return media, None
    if not any(span.encoder for span in media):
        return media, await asyncio.to_thread(engine.prepare_media, media)
    if embeddings is None:
        raise InvalidRequest(f"{media[0].name}: only a prefill worker pulls images' embeddings from an encode "
                             "worker; send the image's data")
    pulled = await embeddings.pull(engine, media, request_id)
    return media, await asyncio.to_thread(engine.prepare_media, media, pulled)


async def checked_lora(engine: PrefillBackend | DecodeBackend, msg: pb.LoraAdapter) -> LoadedLora | None:
    """The request's adapter pinned on this worker (loaded first when needed, waiting while every place is
    pinned); None for the base model. InvalidRequest when this backend serves none, LoraUnavailable when this
    worker cannot load it. The caller releases it (the backend's `release`, or `loras.release` if it never got
    there)."""
    ref = lora_from_pb(msg)
    if ref is None:
        return None
    if engine.loras is None:
        refuse_lora(ref, "this worker (started with --max-loras 0, or a simulated one)")
    return await engine.loras.acquire(ref)
