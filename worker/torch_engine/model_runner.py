"""The only module that calls the model: loads a checkpoint on its device and runs packed forwards over the pool.

A forward is one row of tokens: one per decoding sequence, then prompt chunks. Each token's
position and slot come from its sequence's block table; attention (`paged_attention`) reads and
writes the pool. Logits are computed only where a token is sampled (`logits_to_keep`).

A vision-language checkpoint (a config with a `vision_config`) loads as the auto image-text class, its text model
on the paged attention and its vision tower on SDPA; a chunk covering image positions is fed input embeddings with
the image's encoder output (`vision.VisionEncoder`) in those rows. Only architectures with one position per token
are served (LLaVA): a decode worker continues them from token ids alone.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.utils import logging as hf_logging

from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.media import MediaSpan, refuse_media
from adapters.peft_folder import AdapterRef
from kv_transfer.wire import kv_tensor_shape
from worker.engine.lora import LoadedLora
from worker.engine.sequence import TokenLogprobs
from worker.torch_engine.sampling import batch_logprobs
from worker.torch_engine.kv_cache import KvCache
from worker.torch_engine.lora import load_lora_weights, lora_rows, wrap_projections
from worker.torch_engine.attention_plan import MIN_SHARED_BLOCKS, build_plan
from worker.torch_engine.decode_graphs import (GRAPH_MAX_CONTEXT, CaptureReport, DecodeGraphs, graphs_refusal,
                                               reserve_bytes)
from worker.torch_engine.decode_step import DecodeStep
from worker.torch_engine.paged_attention import ATTENTION_NAME, AttentionBatch, PrefillSegment, attention_batch
from worker.engine.scheduler import Chunk
from worker.torch_engine.vision import PreparedMedia, VisionEncoder
from worker.torch_engine.model_support import (DTYPES, refuse_unsupported_attention, refuse_unsupported_vision,
                                                 resolve_attention, resolve_device)

logger = logging.getLogger(__name__)

# Prompt positions scored per log-softmax: bounds the float32 [rows, vocabulary] copies a long chunk makes.
SCORED_ROWS = 256


def scored_tokens(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Each target token's logprob, rank and `top` likeliest alternatives under its row of `logits` [n, V] (the
    raw distribution, as vLLM reports prompt logprobs), SCORED_ROWS rows at a time."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), SCORED_ROWS):
        part = targets[start : start + SCORED_ROWS]
        out.extend(batch_logprobs(logits[start : start + len(part)], part, [top] * len(part), ranks=True))
    return out


# Below this many blocks in common, a shared prefix is attended with each row's own blocks (one gather, SDPA).
def shared_leading_blocks(decode: Sequence[DecodeRow], block_size: int) -> list[int]:
    """The leading blocks every decode row holds (the same block ids: cached blocks shared through the prefix
    cache), before any row's current block; [] for a single row."""
    if len(decode) < 2:
        return []
    first = decode[0].table.block_ids
    n = min(row.position // block_size for row in decode)  # blocks wholly before every row's current one
    for row in decode[1:]:
        ids = row.table.block_ids
        i = 0
        while i < n and ids[i] == first[i]:
            i += 1
        n = i
        if not n:
            return []
    return first[:n]


@dataclass(frozen=True)
class DecodeRow:
    """One decoding sequence's next input: its last token at `position` (its KV goes there)."""

    token_id: int
    position: int
    table: BlockTable
    lora: LoadedLora | None = None  # the adapter its sequence runs under


@dataclass(frozen=True)
class PromptChunk:
    """Positions [start, start + len(token_ids)) of a prompt; `logits`: sample after its last token."""

    token_ids: Sequence[int]
    start: int
    table: BlockTable
    logits: bool
    media: Sequence[MediaSpan] = ()  # the images overlapping the chunk, whose encoder rows fill their positions
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # those images' encoder output, by content hash
    lora: LoadedLora | None = None  # the adapter its prompt runs under
    prompt_logprobs: int | None = None  # report each position's next-token logprob, with this many alternatives
    following: int | None = None  # the prompt token after the chunk (None: the chunk ends the prompt)
    verify: bool = False  # a decode row's last token and its draft: logits after every position, not just the last


class ModelRunner:
    """Owns the model, the tokenizer and the KV pool's tensors; called only from an engine thread."""

    def __init__(self, model_dir: Path | str, dtype: str = "auto", device: str = "auto", encoder_cache_items: int = 32,
                 max_loras: int | None = 0, max_lora_rank: int = 16, attention: str = "auto",
                 enforce_eager: bool = False, pad_decode_steps: bool | None = None):
        self.model_dir = Path(model_dir)
        self.enforce_eager = enforce_eager  # never capture decode steps as CUDA graphs
        # Pad decode steps to their batch buckets; None: only where they are captured (padding buys nothing eager).
        self.pad_decode_steps = pad_decode_steps
        self.device = resolve_device(device)
        self.attention_requested = attention
        self.attention = resolve_attention(attention, self.device)
        hf_logging.disable_progress_bar()  # keep worker logs quiet and line-structured
        kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
        config = AutoConfig.from_pretrained(self.model_dir)
        self.vision: VisionEncoder | None = None
        if hasattr(config, "vision_config"):
            refuse_unsupported_vision(config)
            self.model = AutoModelForImageTextToText.from_pretrained(
                self.model_dir, attn_implementation={"text_config": ATTENTION_NAME, "vision_config": "sdpa"},
                **kwargs).to(self.device).eval()
            from transformers import AutoProcessor  # image processing: its import costs a text model's start-up

            self.vision = VisionEncoder(self.model, AutoProcessor.from_pretrained(self.model_dir), self.device,
                                        encoder_cache_items)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, attn_implementation=ATTENTION_NAME, **kwargs).to(self.device).eval()
        self.config = self.model.config.get_text_config()  # the language model's: layers, heads, vocabulary
        refuse_unsupported_attention(self.config)
        if max_loras is None:  # the default: adapters on a text model only
            max_loras = 0 if self.vision is not None else 4
        if max_loras < 0 or max_lora_rank < 1:
            raise ValueError(f"--max-loras {max_loras} must be >= 0 and --max-lora-rank {max_lora_rank} >= 1")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.lora_shapes = {}  # target projection -> shape, once wrapped for adapters (max_loras > 0)
        self.lora_projections = []
        if max_loras:
            if self.vision is not None:
                raise ValueError(f"{config.model_type}: LoRA adapters on a vision-language model are not supported "
                                 "yet (start it with --max-loras 0)")
            self.lora_shapes, self.lora_projections = wrap_projections(self.model, max_loras, max_lora_rank)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.cache: KvCache | None = None
        self.block_size = 0
        self.block_pool: BlockPool | None = None  # whose blocks `cache` holds (set by `paged_pool`)
        self.decode_step: DecodeStep | None = None  # pure decode steps, bucketed (made with the cache)
        logger.info("loaded %s (%s, %s) on %s, attention %s", self.model_dir, type(self.model).__name__,
                    self.model.dtype, self.device, self.attention)

    def prepare_media(self, media: Sequence[MediaSpan], pulled: dict | None = None
                      ) -> PreparedMedia | None:
        """What a request's images need for its forwards (with the encoder outputs `pulled` from encode workers);
        InvalidRequest unless every item decodes and fits its span (a text model takes none)."""
        if self.vision is None:
            refuse_media(media, self.model_dir.name)
            return None
        return self.vision.prepare(media, pulled)

    def embeddings_wanted(self, media: Sequence[MediaSpan]) -> tuple[list, dict]:
        """The items to pull from encode workers with the shape this model takes for each, and the outputs held
        here for the others (vision.py)."""
        if self.vision is None:
            refuse_media(media, self.model_dir.name)
            return [], {}
        return self.vision.wanted(media)

    def load_lora(self, ref: AdapterRef, slot: int) -> int:
        """Read an adapter's weights into place `slot` of every adapted projection (blocking: called on a thread by
        the residency; no running request uses that place while it is written)."""
        weights = load_lora_weights(ref, self.lora_shapes, self.num_layers, self.max_lora_rank, self.device, self.dtype)
        with torch.inference_mode():
            for projection in self.lora_projections:
                projection.write_slot(slot, weights.get(projection.key))
        return slot

    def prompt_chunks(self, chunks: Sequence[Chunk], sample: Callable[[Chunk], bool]
                      ) -> tuple[list[PromptChunk], list[tuple[Chunk, Exception]]]:
        """The forward's PromptChunks for scheduled chunks (`sample`: logits after it), each with the encoder rows of
        the images it covers; chunks whose images fail to encode come back apart, with the error, so that only
        their requests fail."""
        prompt_chunks, failed = [], []
        for chunk in chunks:
            work = chunk.work
            media = [s for s in work.media if s.offset < chunk.end and s.end > chunk.start] if work.media else ()
            features = {}
            if media:
                try:
                    features = self.vision.embeddings(media, work.prepared_media or PreparedMedia())
                except Exception as exc:  # noqa: BLE001 (a bad image, or the encoder's own failure: its request's)
                    failed.append((chunk, exc))
                    continue
            following = work.token_ids[chunk.end] if chunk.end < len(work.token_ids) else None
            prompt_chunks.append(PromptChunk(work.token_ids[chunk.start : chunk.end], chunk.start, work.table,
                                             sample(chunk), media, features, work.lora, work.prompt_logprobs,
                                             following))
        return prompt_chunks, failed

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        """The width of the logits (token ids a mask or a bias may name)."""
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_shape(self, seq_len: int) -> tuple[int, int, int]:
        """Shape of one layer's key (or value) for `seq_len` positions as the pool and the wire hold it:
        [positions, kv_heads, head_dim]."""
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return kv_tensor_shape(seq_len, kv_heads, head_dim)

    def kv_bytes_per_token(self) -> int:
        _, kv_heads, head_dim = self.kv_shape(1)
        return 2 * self.num_layers * kv_heads * head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def graphs_refused(self) -> str | None:
        """Why this runner's decode steps are not captured as CUDA graphs (None: they are)."""
        return graphs_refusal(self.device, self.enforce_eager, self.config)

    @property
    def max_context(self) -> int:
        """The positions a sequence may reach: the checkpoint's `max_position_embeddings`."""
        return getattr(self.config, "max_position_embeddings", None) or 8192

    def graph_reserve_bytes(self, max_rows: int, block_size: int) -> int:
        """Device memory to keep out of the KV pool for the decode graphs of steps of `max_rows` rows (0: none)."""
        if self.graphs_refused:
            return 0
        per_position = self.kv_bytes_per_token() // (2 * self.num_layers)
        return reserve_bytes(max_rows, self.step_context(), block_size, per_position, self.vocab_size)

    def allocate_cache(self, num_blocks: int, block_size: int, max_decode_rows: int = 64) -> None:
        """Make the pool's tensors: `num_blocks` blocks of `block_size` positions on every layer; and the bucketed
        decode step over them, for steps of up to `max_decode_rows` rows."""
        self.release_cache()
        _, kv_heads, head_dim = self.kv_shape(1)
        if self.attention == "kernel" and (block_size % 8 or head_dim % 8):
            # The kernel reads eight positions and eight lanes at a time.
            message = (f"the paged kernel needs a block size and head_dim that are multiples of 8 (block size "
                       f"{block_size}, head_dim {head_dim})")
            if self.attention_requested == "kernel":
                raise ValueError(f"--attention kernel: {message}")
            logger.warning("%s: attending with torch (gathers blocks)", message)
            self.attention = "torch"
        self.cache = KvCache(self.num_layers, num_blocks, block_size, kv_heads, head_dim, self.dtype, self.device)
        self.block_size = block_size
        pad = self.pad_decode_steps
        if pad is None:
            pad = self.graphs_refused is None
        self.decode_step = DecodeStep(self.model, self.cache, max_decode_rows, self.step_context(num_blocks),
                                      self.attention == "kernel", (self.max_loras, self.max_lora_rank), pad)

    def step_context(self, num_blocks: int | None = None) -> int:
        """The longest context a decode step runs bucketed (longer rows run packed): the checkpoint's, at most
        GRAPH_MAX_CONTEXT (the tables and gather buffers grow with it) and what a pool of `num_blocks` holds."""
        context = min(self.max_context, GRAPH_MAX_CONTEXT)
        return context if num_blocks is None else min(context, num_blocks * self.block_size)

    def release_cache(self) -> None:
        """Let the pool's tensors go, with the decode step and its graphs (their memory too)."""
        if self.decode_step is not None:
            self.decode_step.graphs = None
        self.decode_step = None
        self.cache = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def capture_graphs(self) -> CaptureReport | None:
        """Capture the decode step's CUDA graphs (after `allocate_cache`); None, logged, where they are not made."""
        if self.graphs_refused is not None:
            logger.info("decode steps run eagerly: %s", self.graphs_refused)
            return None
        return DecodeGraphs(self.decode_step).capture()

    # slots -----------------------------------------------------------------------------------
    def _slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        blocks = torch.tensor(table.block_ids[first:last], dtype=torch.long)
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)
        return slots[start - first * bs : end - first * bs]

    def _zero_fresh_blocks(self) -> None:
        fresh = self.block_pool.take_fresh() if self.block_pool is not None else []
        if fresh:
            self.cache.zero_blocks(fresh)

    def write_kv(self, table: BlockTable, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a transferred cache of positions [start, start + n) ([n, kv_heads, head_dim] per layer) into `table`'s
        slots."""
        n = layers[0][0].shape[0]
        with torch.inference_mode():
            self._zero_fresh_blocks()
            self.cache.write(self._slots(table, start, start + n), layers)

    def kv_slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """The pool slots of positions [start, end) of `table`, on the device (for `read_kv`)."""
        return self._slots(table, start, end).to(self.device)

    def read_kv(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values at `slots` (`kv_slots`), as host tensors in the wire's layout."""
        with torch.inference_mode():
            return self.cache.read(layer, slots)

    # forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, decode: Sequence[DecodeRow], chunks: Sequence[PromptChunk],
                on_layer: Callable[[int], None] | None = None,
                        prompt_logprobs: dict[int, list] | None = None) -> torch.Tensor:
        """One packed forward; logits [rows, V]: one per decode row, then one per chunk with `logits` (one per
        position of a `verify` chunk). A chunk with
        `prompt_logprobs` gets, in `prompt_logprobs[its index]`, the TokenLogprobs (with rank) of each prompt token
        it predicts (the token after each of its positions, as far as the prompt goes). Decode rows alone run as the
        bucketed step (decode_step.py) where they fit it."""
        self._zero_fresh_blocks()
        if not chunks and decode and self.decode_step is not None and self.decode_step.fits(decode):
            return self.decode_step.run(decode, on_layer)
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        keep: list[int] = []
        for row in decode:
            ids.append(row.token_id)
            positions.append(row.position)
        nd = len(decode)
        keep.extend(range(nd))
        batch = AttentionBatch(self.cache, slots=torch.empty(0), num_decode=nd, on_layer=on_layer)
        kernel = self.attention == "kernel"
        if nd and not kernel:
            slot_parts.append(self._decode_inputs(decode, batch))
        elif nd:
            slot_parts.append(self._decode_slots(decode))
        segments, paged_chunks = [], []
        for chunk in chunks:
            start, n = chunk.start, len(chunk.token_ids)
            seg = PrefillSegment(len(ids), len(ids) + n)
            segments.append(seg)
            ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slot_parts.append(self._slots(chunk.table, start, start + n))
            if start and kernel:
                paged_chunks.append((chunk.table.block_ids, seg.start, start, n))
                continue
            if start:
                seg.context_slots = self._slots(chunk.table, 0, start + n).to(self.device)
            batch.segments.append(seg)
        for chunk, seg in zip(chunks, segments):
            if chunk.verify:
                keep.extend(range(seg.start, seg.end))
            elif chunk.logits:
                keep.append(seg.end - 1)
        if kernel and (nd or paged_chunks):
            batch.kernel = build_plan([(row.table.block_ids, row.position) for row in decode], paged_chunks,
                                      self.block_size)
        # Rows whose logits score the prompt itself go after the sampled ones.
        scored = [(i, seg.start, seg.end) for i, (chunk, seg) in enumerate(zip(chunks, segments))
                  if chunk.prompt_logprobs is not None and prompt_logprobs is not None]
        rows = keep + [r for _, start, end in scored for r in range(start, end)]
        batch.slots = torch.cat(slot_parts).to(self.device)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        inputs = {"input_ids": input_ids}
        if any(chunk.media for chunk in chunks):
            inputs = {"inputs_embeds": self._embeds_with_media(input_ids, len(decode), chunks)}
        adapters = lora_rows([row.lora.slot if row.lora is not None else -1 for row in decode],
                             [(seg.start, seg.end, chunk.lora.slot) for chunk, seg in zip(chunks, segments)
                              if chunk.lora is not None], self.max_lora_rank, self.max_loras, self.device, self.dtype)
        with attention_batch(batch), adapters:
            out = self.model(**inputs, position_ids=position_ids, use_cache=False,
                             logits_to_keep=torch.tensor(rows, dtype=torch.long, device=self.device))
        logits = out.logits[0]
        offset = len(keep)
        for i, start, end in scored:
            chunk = chunks[i]
            targets = list(chunk.token_ids[1:]) + ([chunk.following] if chunk.following is not None else [])
            prompt_logprobs[i] = scored_tokens(logits[offset : offset + len(targets)], targets, chunk.prompt_logprobs)
            offset += end - start
        return logits[: len(keep)].float()



    def _embeds_with_media(self, input_ids: torch.Tensor, row: int, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """The row's token embeddings, with each image's encoder output in the positions of it a chunk computes
        (`row`: where the first chunk starts in the packed row)."""
        embeds = self.model.get_input_embeddings()(input_ids)
        for chunk in chunks:
            end = chunk.start + len(chunk.token_ids)
            for span in chunk.media:
                lo, hi = max(span.offset, chunk.start), min(span.end, end)
                embeds[0, row + lo - chunk.start : row + hi - chunk.start] = \
                    chunk.features[span.content_hash][lo - span.offset : hi - span.offset].to(embeds.dtype)
            row += len(chunk.token_ids)
        return embeds

    def _decode_slots(self, decode: Sequence[DecodeRow]) -> torch.Tensor:
        """The decode tokens' own slots (where each row's new key and value go)."""
        bs = self.block_size
        return torch.tensor([row.table.block_ids[row.position // bs] * bs + row.position % bs for row in decode],
                            dtype=torch.long)

    def _decode_inputs(self, decode: Sequence[DecodeRow], batch: AttentionBatch) -> torch.Tensor:
        """Fill the batch's decode blocks and mask (and the leading blocks all rows share); return the decode
        tokens' own slots."""
        bs = self.block_size
        width_blocks = max(row.position // bs + 1 for row in decode)
        shared = shared_leading_blocks(decode, bs)
        if len(shared) >= MIN_SHARED_BLOCKS:
            batch.shared_blocks = torch.tensor(shared, dtype=torch.long, device=self.device)
        else:
            shared = []
        p = len(shared)
        tables = torch.tensor([row.table.block_ids[p:width_blocks] + [0] * (width_blocks - len(row.table.block_ids))
                               for row in decode], dtype=torch.long)
        lengths = torch.tensor([row.position + 1 for row in decode])
        mask = torch.arange(p * bs, width_blocks * bs).unsqueeze(0) < lengths.unsqueeze(1)
        batch.decode_blocks = tables.reshape(-1).to(self.device)
        batch.decode_mask = mask[:, None, None, :].to(self.device)
        return self._decode_slots(decode)
