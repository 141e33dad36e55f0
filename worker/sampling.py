"""Turn one row of logits into a token: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import torch

from worker.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, index: int) -> int:
    """A per-token seed, so the same request samples the same token on any worker."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & (_MASK64 >> 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Pick the token for output position `index` from a 1-D logits vector."""
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
