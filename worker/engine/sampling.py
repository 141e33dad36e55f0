"""One row of logits to a token: penalties and masks, then greedy or seeded sampling; logprobs."""

from __future__ import annotations

from collections.abc import Iterable

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


def choose(raw_logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
           eos_ids: Iterable[int]) -> tuple[int, TokenLogprobs | None]:
    """The whole per-token pipeline: penalties, early-stop masks, sampling, logprobs."""
    index = len(output_ids)
    logits = apply_penalties(raw_logits, params, prompt_ids, output_ids)
    logits = mask_early_stops(logits, params, index, eos_ids)
    token = sample_token(logits, params, index)
    return token, (token_logprobs(raw_logits, token, params.top_logprobs) if params.return_logprobs else None)
