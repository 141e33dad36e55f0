from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_REASON_UNSPECIFIED: _ClassVar[FailureReason]
    FAILURE_REASON_CALL_DEADLINE: _ClassVar[FailureReason]
    FAILURE_REASON_KV_SEND_FAILED: _ClassVar[FailureReason]
    FAILURE_REASON_KV_NOT_RECEIVED: _ClassVar[FailureReason]
    FAILURE_REASON_KV_CORRUPT: _ClassVar[FailureReason]
    FAILURE_REASON_KV_LEASE_EXPIRED: _ClassVar[FailureReason]
    FAILURE_REASON_DRAINING: _ClassVar[FailureReason]
    FAILURE_REASON_PREEMPTED: _ClassVar[FailureReason]
    FAILURE_REASON_LORA_UNAVAILABLE: _ClassVar[FailureReason]
    FAILURE_REASON_EMBEDDINGS_UNAVAILABLE: _ClassVar[FailureReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FAILURE_REASON_UNSPECIFIED: FailureReason
FAILURE_REASON_CALL_DEADLINE: FailureReason
FAILURE_REASON_KV_SEND_FAILED: FailureReason
FAILURE_REASON_KV_NOT_RECEIVED: FailureReason
FAILURE_REASON_KV_CORRUPT: FailureReason
FAILURE_REASON_KV_LEASE_EXPIRED: FailureReason
FAILURE_REASON_DRAINING: FailureReason
FAILURE_REASON_PREEMPTED: FailureReason
FAILURE_REASON_LORA_UNAVAILABLE: FailureReason
FAILURE_REASON_EMBEDDINGS_UNAVAILABLE: FailureReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "has_seed", "max_tokens", "stop", "skip_special_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "return_logprobs", "top_logprobs", "guided", "logit_bias", "typical_p", "return_prompt_logprobs", "prompt_top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    return_logprobs: bool
    top_logprobs: int
    guided: GuidedDecoding
    logit_bias: _containers.ScalarMap[int, float]
    typical_p: float
    return_prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., typical_p: _Optional[float] = ..., return_prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("grammar", "generated_token_ids")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    grammar: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, grammar: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("logprob", "rank", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "kv_data_address", "kv_transfer_token", "traceparent", "decode_cached_tokens", "media", "lora", "kv_layout_version", "pull_from", "pull_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_address: str
    kv_data_address: str
    kv_transfer_token: str
    traceparent: str
    decode_cached_tokens: int
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    lora: LoraAdapter
    kv_layout_version: int
    pull_from: str
    pull_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., kv_data_address: _Optional[str] = ..., kv_transfer_token: _Optional[str] = ..., traceparent: _Optional[str] = ..., decode_cached_tokens: _Optional[int] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., kv_layout_version: _Optional[int] = ..., pull_from: _Optional[str] = ..., pull_tokens: _Optional[int] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("kind", "data", "content_hash", "offset", "num_tokens", "source", "encoder")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    data: bytes
    content_hash: bytes
    offset: int
    num_tokens: int
    source: str
    encoder: str
    def __init__(self, kind: _Optional[str] = ..., data: _Optional[bytes] = ..., content_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., source: _Optional[str] = ..., encoder: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "prefill_time_ms", "kv_bytes", "kv_transfer_ms", "forward_ms", "token_channel_address")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANNEL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    prefill_time_ms: float
    kv_bytes: int
    kv_transfer_ms: float
    forward_ms: float
    token_channel_address: str
    def __init__(self, first_token_id: _Optional[int] = ..., prefill_time_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., token_channel_address: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_len", "sampling", "max_seq_len", "prompt_token_ids", "local_prefill", "traceparent", "media", "lora", "draft_hints", "no_drafts", "held_text_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HINTS_FIELD_NUMBER: _ClassVar[int]
    NO_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HELD_TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    sampling: SamplingParams
    max_seq_len: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    local_prefill: bool
    traceparent: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    lora: LoraAdapter
    draft_hints: _containers.RepeatedCompositeFieldContainer[DraftHint]
    no_drafts: bool
    held_text_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_seq_len: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., local_prefill: _Optional[bool] = ..., traceparent: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., draft_hints: _Optional[_Iterable[_Union[DraftHint, _Mapping]]] = ..., no_drafts: _Optional[bool] = ..., held_text_tokens: _Optional[int] = ...) -> None: ...

class DraftHint(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("accepted", "token")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    token: TokenEvent
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("kv_data_address", "kv_transfer_token", "token_channel_address", "cached_tokens", "kv_layout_version")
    KV_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANNEL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    kv_data_address: str
    kv_transfer_token: str
    token_channel_address: str
    cached_tokens: int
    kv_layout_version: int
    def __init__(self, kv_data_address: _Optional[str] = ..., kv_transfer_token: _Optional[str] = ..., token_channel_address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., kv_layout_version: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "text", "time_ms", "finish_reason", "index", "matched_stop", "logprob", "top_logprobs", "batch_size", "queue_wait_ms", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    time_ms: float
    finish_reason: FinishReason
    index: int
    matched_stop: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    batch_size: int
    queue_wait_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., time_ms: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., index: _Optional[int] = ..., matched_stop: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., batch_size: _Optional[int] = ..., queue_wait_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("role", "model", "num_running", "num_waiting", "kv_capacity_tokens", "kv_used_tokens", "num_kv_leases", "queued_prompt_tokens", "draining", "kv_block_size", "kv_blocks", "kv_free_blocks", "kv_cached_blocks", "prefix_hit_tokens", "prefix_queried_tokens", "num_preemptions", "max_loras", "lora_resident", "lora_running", "lora_waiting", "kv_tier_blocks", "tier_hit_tokens", "kv_pulls", "kv_pulled_bytes", "release", "wire_formats")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LORA_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LORA_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORMATS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    num_kv_leases: int
    queued_prompt_tokens: int
    draining: bool
    kv_block_size: int
    kv_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    num_preemptions: int
    max_loras: int
    lora_resident: _containers.RepeatedScalarFieldContainer[str]
    lora_running: _containers.RepeatedScalarFieldContainer[str]
    lora_waiting: _containers.RepeatedScalarFieldContainer[str]
    kv_tier_blocks: int
    tier_hit_tokens: int
    kv_pulls: int
    kv_pulled_bytes: int
    release: str
    wire_formats: _containers.RepeatedCompositeFieldContainer[WireFormatRange]
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., num_kv_leases: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_block_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_free_blocks: _Optional[int] = ..., kv_cached_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., max_loras: _Optional[int] = ..., lora_resident: _Optional[_Iterable[str]] = ..., lora_running: _Optional[_Iterable[str]] = ..., lora_waiting: _Optional[_Iterable[str]] = ..., kv_tier_blocks: _Optional[int] = ..., tier_hit_tokens: _Optional[int] = ..., kv_pulls: _Optional[int] = ..., kv_pulled_bytes: _Optional[int] = ..., release: _Optional[str] = ..., wire_formats: _Optional[_Iterable[_Union[WireFormatRange, _Mapping]]] = ...) -> None: ...

class WireFormatRange(_message.Message):
    __slots__ = ("name", "oldest", "newest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OLDEST_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    oldest: int
    newest: int
    def __init__(self, name: _Optional[str] = ..., oldest: _Optional[int] = ..., newest: _Optional[int] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("request_id", "dtype", "num_layers", "shape", "tensor_bytes", "transfer_token", "first_position", "lora_digest", "kv_layout_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dtype: str
    num_layers: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    tensor_bytes: int
    transfer_token: str
    first_position: int
    lora_digest: bytes
    kv_layout_version: int
    def __init__(self, request_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., tensor_bytes: _Optional[int] = ..., transfer_token: _Optional[str] = ..., first_position: _Optional[int] = ..., lora_digest: _Optional[bytes] = ..., kv_layout_version: _Optional[int] = ...) -> None: ...

class KvTrailer(_message.Message):
    __slots__ = ("first_token_id", "prefill_time_ms", "first_logprob", "first_top_logprobs", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    prefill_time_ms: float
    first_logprob: float
    first_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., prefill_time_ms: _Optional[float] = ..., first_logprob: _Optional[float] = ..., first_top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("layer", "is_value", "offset", "data", "checksum")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    IS_VALUE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    is_value: bool
    offset: int
    data: bytes
    checksum: int
    def __init__(self, layer: _Optional[int] = ..., is_value: _Optional[bool] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KvMessage(_message.Message):
    __slots__ = ("header", "block", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    block: KvBlock
    trailer: KvTrailer
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., block: _Optional[_Union[KvBlock, _Mapping]] = ..., trailer: _Optional[_Union[KvTrailer, _Mapping]] = ...) -> None: ...

class KvAck(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class TokenChannelHello(_message.Message):
    __slots__ = ("worker_secret", "token_records")
    WORKER_SECRET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    worker_secret: str
    token_records: bool
    def __init__(self, worker_secret: _Optional[str] = ..., token_records: _Optional[bool] = ...) -> None: ...

class TokenChannelRequest(_message.Message):
    __slots__ = ("decode", "cancel", "prefill", "health", "watch_kv_events", "timeout_s")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    WATCH_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    cancel: str
    prefill: PrefillRequest
    health: str
    watch_kv_events: WatchKvEventsRequest
    timeout_s: float
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., health: _Optional[str] = ..., watch_kv_events: _Optional[_Union[WatchKvEventsRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ChannelError(_message.Message):
    __slots__ = ("code", "details", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    details: str
    reason: FailureReason
    def __init__(self, code: _Optional[str] = ..., details: _Optional[str] = ..., reason: _Optional[_Union[FailureReason, str]] = ...) -> None: ...

class RoutedEvent(_message.Message):
    __slots__ = ("request_id", "accepted", "token", "error", "prefilled", "health")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: Accepted
    token: TokenEvent
    error: ChannelError
    prefilled: PrefillResponse
    health: HealthResponse
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., error: _Optional[_Union[ChannelError, _Mapping]] = ..., prefilled: _Optional[_Union[PrefillResponse, _Mapping]] = ..., health: _Optional[_Union[HealthResponse, _Mapping]] = ...) -> None: ...

class TokenChannelFrame(_message.Message):
    __slots__ = ("channel_id", "events", "refused", "answers_health", "kv_events", "streams_kv_events")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_HEALTH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    events: _containers.RepeatedCompositeFieldContainer[RoutedEvent]
    refused: str
    answers_health: bool
    kv_events: _containers.RepeatedCompositeFieldContainer[KvEventBatch]
    streams_kv_events: bool
    def __init__(self, channel_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[RoutedEvent, _Mapping]]] = ..., refused: _Optional[str] = ..., answers_health: _Optional[bool] = ..., kv_events: _Optional[_Iterable[_Union[KvEventBatch, _Mapping]]] = ..., streams_kv_events: _Optional[bool] = ...) -> None: ...

class KvBlockEvent(_message.Message):
    __slots__ = ("hash", "parent_hash", "num_tokens", "removed", "medium")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    parent_hash: bytes
    num_tokens: int
    removed: bool
    medium: int
    def __init__(self, hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., removed: _Optional[bool] = ..., medium: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "snapshot", "role", "block_size", "events")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    snapshot: bool
    role: str
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KvBlockEvent]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., snapshot: _Optional[bool] = ..., role: _Optional[str] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvBlockEvent, _Mapping]]] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "max_tokens", "block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    block_size: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    drain_timeout_s: float
    def __init__(self, role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "in_flight")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    previous_role: str
    role: str
    in_flight: int
    def __init__(self, previous_role: _Optional[str] = ..., role: _Optional[str] = ..., in_flight: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "media")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    def __init__(self, request_id: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ...) -> None: ...

class EncodedItem(_message.Message):
    __slots__ = ("content_hash", "rows", "hidden", "cached")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    rows: int
    hidden: int
    cached: bool
    def __init__(self, content_hash: _Optional[bytes] = ..., rows: _Optional[int] = ..., hidden: _Optional[int] = ..., cached: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "busy_ms")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodedItem]
    busy_ms: float
    def __init__(self, items: _Optional[_Iterable[_Union[EncodedItem, _Mapping]]] = ..., busy_ms: _Optional[float] = ...) -> None: ...

class PullEmbeddingsRequest(_message.Message):
    __slots__ = ("request_id", "content_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    content_hash: bytes
    def __init__(self, request_id: _Optional[str] = ..., content_hash: _Optional[bytes] = ...) -> None: ...

class EmbeddingsHeader(_message.Message):
    __slots__ = ("content_hash", "rows", "hidden", "dtype", "num_bytes")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    rows: int
    hidden: int
    dtype: str
    num_bytes: int
    def __init__(self, content_hash: _Optional[bytes] = ..., rows: _Optional[int] = ..., hidden: _Optional[int] = ..., dtype: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class EmbeddingsChunk(_message.Message):
    __slots__ = ("data", "checksum")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    checksum: int
    def __init__(self, data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class EmbeddingsMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: EmbeddingsHeader
    chunk: EmbeddingsChunk
    def __init__(self, header: _Optional[_Union[EmbeddingsHeader, _Mapping]] = ..., chunk: _Optional[_Union[EmbeddingsChunk, _Mapping]] = ...) -> None: ...
