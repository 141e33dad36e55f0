"""A GenerationRequest's parts as worker.proto messages: sampling rules, images, the adapter, draft hints."""

from __future__ import annotations

from coordinator.requests.request import GenerationRequest, MediaInput
from kv_events.block_hash import hash_to_bytes
from proto import worker_pb2 as pb


def sampling_to_pb(request: GenerationRequest, max_tokens: int) -> pb.SamplingParams:
    s = request.sampling
    guided = None
    if s.guided is not None:
        guided = pb.GuidedDecoding(grammar=s.guided.grammar, generated_token_ids=list(s.guided.generated))
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
        guided=guided,
        logit_bias=dict(s.logit_bias),
        typical_p=s.typical_p,
        return_prompt_logprobs=s.prompt_logprobs is not None,
        prompt_top_logprobs=s.prompt_logprobs or 0,
    )


def media_to_pb(media: tuple[MediaInput, ...], with_data: bool) -> list[pb.MediaItem]:
    """A prompt's images as MediaItems: with their files for a prefill (or, for one an encode worker holds, that
    worker's address instead), identities only for a decode worker fed by a transfer."""
    return [pb.MediaItem(kind=m.kind, data=m.data if with_data and not m.encoder else b"",
                         content_hash=hash_to_bytes(m.content_hash), offset=m.offset, num_tokens=m.num_tokens,
                         source=m.source, encoder=m.encoder if with_data else "") for m in media]


def lora_to_pb(request: GenerationRequest) -> pb.LoraAdapter | None:
    """The request's adapter as the workers load it (None: the base model, the field left out)."""
    lora = request.lora
    if lora is None:
        return None
    return pb.LoraAdapter(name=lora.name, path=lora.path, digest=hash_to_bytes(lora.digest))


def add_draft_hints(message: pb.DecodeRequest, hints: tuple[bytes, ...]) -> None:
    """Draft hints (each an encoded pb.DraftHint) added to a DecodeRequest."""
    for hint in hints:
        message.draft_hints.add().MergeFromString(hint)


def hints_size(hints: tuple[bytes, ...]) -> int:
    """What draft hints add to a DecodeRequest's size, at most (each a tag and a length before it)."""
    return sum(len(hint) + 6 for hint in hints) if hints else 0
