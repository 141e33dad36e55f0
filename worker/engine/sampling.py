"""Logits to tokens: penalties, logit_bias and masks (grammar masks for a whole step at once), then greedy
or seeded sampling; logprobs of the raw distribution."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from worker.engine.sequence import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, index: int) -> int:
    """A per-token seed, so the same request samples the same token on any worker."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & (_MASK64 >> 1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition penalty over prompt and output (CTRL: divide positive logits, multiply negative);
    presence and frequency penalties over the output (OpenAI: minus p once, minus f per use)."""
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                       picked * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.numel()).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@functools.lru_cache(maxsize=256)
def _bias_tensors(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached per distinct bias table: a request's rows reuse the same two tensors every step.
    ids, biases = zip(*logit_bias)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=torch.float32)


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's bias added to its logit (-100 all but bans, +100 all but forces)."""
    if not params.logit_bias:
        return logits
    ids, biases = _bias_tensors(params.logit_bias)
    return logits.index_add(0, ids, biases.to(logits.dtype))


def mask_early_stops(logits: torch.Tensor, params: SamplingParams, num_generated: int,
                     eos_ids: Iterable[int]) -> torch.Tensor:
    """Before min_tokens exist, EOS and stop tokens cannot be chosen."""
    if num_generated >= params.min_tokens:
        return logits
    banned = [t for t in (*params.stop_token_ids, *([] if params.ignore_eos else eos_ids)) if 0 <= t < logits.numel()]
    if not banned:
        return logits
    logits = logits.clone()
    logits[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Pick the token for output position `index` from a 1-D (already processed) logits vector."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    generator = torch.Generator().manual_seed(step_seed(params.seed or 0, index))
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(raw_logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Log-probabilities under the model's own distribution (before penalties and temperature)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    alternatives = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(logprobs[token]), alternatives)


def process_logits(raw_logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                   output_ids: Sequence[int], eos_ids: Iterable[int], ban_early_stops: bool = True) -> torch.Tensor:
    """What sampling sees before any grammar mask: penalties, then logit_bias, then the early-stop bans.
    Returns `raw_logits` itself when nothing applies."""
    logits = apply_penalties(raw_logits, params, prompt_ids, output_ids)
    logits = apply_logit_bias(logits, params)
    return mask_early_stops(logits, params, len(output_ids), eos_ids) if ban_early_stops else logits


@torch.inference_mode()
def choose(raw_logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
           eos_ids: Iterable[int]) -> tuple[int, TokenLogprobs | None]:
    """One unconstrained row: penalties, logit_bias, early-stop masks, sampling, logprobs."""
    logits = process_logits(raw_logits, params, prompt_ids, output_ids, eos_ids)
    token = sample_token(logits, params, len(output_ids))
    return token, (token_logprobs(raw_logits, token, params.top_logprobs) if params.return_logprobs else None)


Pick = tuple[int, TokenLogprobs | None]


@torch.inference_mode()
def choose_batch(raw: torch.Tensor, rows: Sequence, eos_ids: Iterable[int], masks) -> list[Pick | None]:
    """A token for each row of `raw` [B, V]: `process_logits`, then the grammar masks of all constrained rows
    in one fill, then sampling; logprobs from the raw rows; each matcher consumes its row's token.

    `rows[i]` (a Sequence or a PrefillJob) has `sampling`, `prompt_token_ids`, `output_token_ids` and
    `matcher` (None: unconstrained); `masks` is a GrammarMasks, needed only if some row has a matcher.
    A row whose matcher failed gets None.
    """
    logits = [process_logits(raw[i], row.sampling, row.prompt_token_ids, row.output_token_ids, eos_ids)
              for i, row in enumerate(rows)]
    guided = [i for i, row in enumerate(rows) if row.matcher is not None]
    failed = _mask_guided(raw, rows, guided, logits, eos_ids, masks) if guided else ()
    picks: list[Pick | None] = []
    for i, row in enumerate(rows):
        if i in failed:
            picks.append(None)
            continue
        params = row.sampling
        token = sample_token(logits[i], params, len(row.output_token_ids))
        picks.append((token, token_logprobs(raw[i], token, params.top_logprobs) if params.return_logprobs else None))
    guided = [i for i in guided if picks[i] is not None]
    if guided:
        consumed = masks.consume([rows[i].matcher for i in guided], [picks[i][0] for i in guided])
        for i, ok in zip(guided, consumed):
            if not ok:
                picks[i] = None
    return picks


def _mask_guided(raw: torch.Tensor, rows: Sequence, guided: list[int], logits: list[torch.Tensor],
                 eos_ids: Iterable[int], masks) -> set[int]:
    """Replace the guided rows of `logits` by their grammar-masked copies; return the rows whose matcher failed."""
    matchers = [rows[i].matcher for i in guided]
    banned = masks.banned(matchers)
    stacked = torch.stack([logits[i] for i in guided])
    stacked.masked_fill_(banned, float("-inf"))
    failed = set()
    for j, i in enumerate(guided):
        row = rows[i]
        if matchers[j].is_error():
            failed.add(i)
            continue
        if len(row.output_token_ids) < row.sampling.min_tokens and bool(torch.isneginf(stacked[j]).all()):
            # min_tokens banned all the grammar allows (say, only EOS): the grammar wins, never an empty row.
            redo = process_logits(raw[i], row.sampling, row.prompt_token_ids, row.output_token_ids, eos_ids,
                                  ban_early_stops=False)
            stacked[j] = redo.masked_fill(banned[j], float("-inf"))
        logits[i] = stacked[j]
    return failed
