"""Logits to tokens: penalties, logit_bias and masks (grammar masks for a whole step at once), then greedy
or seeded sampling (temperature, top-k, top-p, typical-p); logprobs of the raw distribution."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from worker.engine.sequence import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1
_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: reductions over more elements run on several threads


def step_seed(seed: int, index: int) -> int:
    """A per-token seed, so the same request samples the same token on any worker."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & (_MASK64 >> 1)


class PenaltyCounts:
    """A sequence's penalty inputs, kept up to date token by token instead of recounted every step: the ids
    its prompt or output hold (repetition) and how often each came out (presence, frequency)."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str = "cpu"):
        self._seen = set(prompt_ids)
        self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.num_counted = 0  # output ids counted so far

    def update(self, output_ids: Sequence[int]) -> PenaltyCounts:
        """Count the output ids added since the last update."""
        new = output_ids[self.num_counted :]
        if new:
            device = self.counts.device
            self.counts.index_put_((torch.tensor(new, dtype=torch.long, device=device),),
                                   torch.ones(len(new), device=device), accumulate=True)
            unseen = sorted(set(new) - self._seen)
            if unseen:
                self._seen.update(unseen)
                self.seen_ids = torch.cat([self.seen_ids, torch.tensor(unseen, dtype=torch.long,
                                                                       device=self.seen_ids.device)])
            self.num_counted = len(output_ids)
        return self


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int], counts: PenaltyCounts | None = None) -> torch.Tensor:
    """Repetition penalty over prompt and output (CTRL: divide positive logits, multiply negative); presence and
    frequency penalties over the output (OpenAI: minus p once, minus f per use); `counts`: both lists, counted."""
    if not params.has_penalties:
        return logits
    if counts is None:
        counts = PenaltyCounts(prompt_ids, logits.numel(), logits.device).update(output_ids)
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and counts.seen_ids.numel():
        seen = counts.seen_ids
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if counts.num_counted and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        used = counts.counts.to(logits.dtype)
        logits -= params.frequency_penalty * used + params.presence_penalty * (used > 0).to(logits.dtype)
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
    return logits.index_add(0, ids.to(logits.device), biases.to(logits.device, logits.dtype))


def mask_early_stops(logits: torch.Tensor, params: SamplingParams, num_generated: int,
                     eos_ids: Iterable[int]) -> torch.Tensor:
    """Before min_tokens exist, EOS and stop tokens cannot be chosen."""
    if num_generated >= params.min_tokens:
        return logits
    banned = [t for t in (*params.stop_token_ids, *([] if params.ignore_eos else eos_ids)) if 0 <= t < logits.numel()]
    if not banned:
        return logits
    logits = logits.clone()
    logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Pick the token for output position `index` from a 1-D (already processed) logits vector."""
    return sample_batch(logits.unsqueeze(0), [params], [index])[0]


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> list[int]:
    """A token for each row of processed `logits` [B, V]: one argmax over all greedy rows; temperature, top-k,
    top-p and typical-p over all sampled rows together, then each row's own seeded draw at its output position."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        for i, token in zip(greedy, _argmax_rows(logits if len(greedy) == len(params) else logits[greedy])):
            tokens[i] = token
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if sampled:
        probs = sampling_probs(logits if len(sampled) == len(params) else logits[sampled],
                                [params[i] for i in sampled])
        for row, i in enumerate(sampled):
            # One generator per row: a seeded request draws the same token whatever else is in the batch.
            # The draw is on the host: the same seed picks the same token on a CPU or a GPU worker.
            generator = torch.Generator().manual_seed(step_seed(params[i].seed or 0, indices[i]))
            tokens[i] = int(torch.multinomial(probs[row].cpu(), 1, generator=generator))
    return tokens


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, in one reduction or, for a small vocabulary, one per chunk of rows."""
    # A reduction over more than the grain size forks onto torch's intra-op threads: for a small vocabulary
    # that costs more than the argmax itself (milliseconds when the cores are busy), so chunks stay under it.
    rows_per_call = _GRAIN_SIZE // logits.shape[-1]
    if rows_per_call <= 1 or rows_per_call >= logits.shape[0]:
        return logits.argmax(dim=-1).tolist()
    return [token for chunk in logits.split(rows_per_call) for token in chunk.argmax(dim=-1).tolist()]


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution after its temperature, top-k, top-p and typical-p, in the order of HF transformers'
    `generate` warpers (and TGI's); rows without a filter skip it."""
    # float32 parameters: exactly what dividing or comparing by the Python number did row by row.
    device = logits.device
    scores = logits.float() / torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                           device=device).unsqueeze(1)
    vocab = scores.shape[-1]
    top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        ks = torch.tensor([params[j].top_k for j in top_k], device=device)
        rows = scores[top_k]
        kth = torch.topk(rows, int(ks.max())).values.gather(1, (ks - 1).unsqueeze(1))
        scores[top_k] = rows.masked_fill(rows < kth, float("-inf"))
    top_p = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        ps = torch.tensor([params[j].top_p for j in top_p], dtype=torch.float32, device=device).unsqueeze(1)
        sorted_scores, order = torch.sort(scores[top_p], dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(probs, dim=-1) - probs >= ps
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores[top_p] = torch.full_like(sorted_scores, float("-inf")).scatter(1, order, sorted_scores)
    typical = [j for j, p in enumerate(params) if 0.0 < p.typical_p < 1.0]
    if typical:
        masses = torch.tensor([params[j].typical_p for j in typical], dtype=torch.float32, device=device)
        scores[typical] = typical_filter(scores[typical], masses.unsqueeze(1))
    return torch.softmax(scores, dim=-1)


def typical_filter(scores: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022) on `scores` [B, V], each row with its mass in `masses`
    [B, 1]: the tokens whose surprisal is closest to the row's entropy, taken closest first until their
    probability reaches the mass (that token included, at least one kept); the others to -inf. The same tokens as
    HF transformers' TypicalLogitsWarper keeps (ties at the cut stay), tokens already at -inf never come back."""
    logprobs = torch.log_softmax(scores, dim=-1)
    entropy = -(logprobs * logprobs.exp()).nansum(-1, keepdim=True)  # -inf * 0 = nan: a filtered token adds 0
    distance, order = torch.sort((-logprobs - entropy).abs(), dim=-1)
    mass_so_far = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (mass_so_far < masses).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)
    drop = distance > distance.gather(1, last)
    drop[:, 0] = False
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def token_logprobs(raw_logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Log-probabilities under the model's own distribution (before penalties and temperature)."""
    return batch_logprobs(raw_logits.unsqueeze(0), [token], [top])[0]


def batch_logprobs(raw: torch.Tensor, tokens: Sequence[int], tops: Sequence[int],
                   ranks: bool = False) -> list[TokenLogprobs]:
    """`token_logprobs` of each row of `raw` [B, V]: one log-softmax and one gather for all rows (with `ranks`, each
    token's rank among the row's, 1 for the likeliest)."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen_t = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long, device=raw.device).unsqueeze(1))
    chosen = chosen_t.squeeze(1).tolist()
    rank_of = ((logprobs > chosen_t).sum(dim=1) + 1).tolist() if ranks else [None] * len(chosen)
    out = []
    for row, (logprob, top, rank) in enumerate(zip(chosen, tops, rank_of)):
        alternatives = ()
        if top > 0:
            values, ids = torch.topk(logprobs[row], min(top, logprobs.shape[-1]))
            alternatives = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprobs(logprob, alternatives, rank))
    return out


def process_logits(raw_logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                   output_ids: Sequence[int], eos_ids: Iterable[int], ban_early_stops: bool = True,
                   counts: PenaltyCounts | None = None) -> torch.Tensor:
    """What sampling sees before any grammar mask: penalties, then logit_bias, then the early-stop bans.
    Returns `raw_logits` itself when nothing applies."""
    logits = apply_penalties(raw_logits, params, prompt_ids, output_ids, counts)
    logits = apply_logit_bias(logits, params)
    return mask_early_stops(logits, params, len(output_ids), eos_ids) if ban_early_stops else logits


def _processes(params: SamplingParams, num_generated: int) -> bool:
    """Whether `process_logits` may change a row (a True that changes nothing costs only a row's copy)."""
    return params.has_penalties or bool(params.logit_bias) or num_generated < params.min_tokens


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
    in one fill, then `sample_batch`; logprobs from the raw rows; each matcher consumes its row's token.

    `rows[i]` (a Sequence or a PrefillJob) has `sampling`, `prompt_token_ids`, `output_token_ids` and
    `matcher` (None: unconstrained), and may have `penalties` (a PenaltyCounts slot, kept across steps);
    `masks` is a GrammarMasks, needed only if some row has a matcher. A row whose matcher failed gets None.
    """
    guided = [i for i, row in enumerate(rows) if row.matcher is not None]
    logits = _processed(raw, rows, eos_ids, copy=bool(guided))
    failed = _mask_guided(raw, rows, guided, logits, eos_ids, masks) if guided else set()
    live = [i for i in range(len(rows)) if i not in failed]
    tokens: list[int | None] = [None] * len(rows)
    picked = sample_batch(logits[live] if failed else logits, [rows[i].sampling for i in live],
                          [len(rows[i].output_token_ids) for i in live])
    for i, token in zip(live, picked):
        tokens[i] = token
    picks = _with_logprobs(raw, rows, tokens)
    guided = [i for i in guided if picks[i] is not None]
    if guided:
        consumed = masks.consume([rows[i].matcher for i in guided], [picks[i][0] for i in guided])
        for i, ok in zip(guided, consumed):
            if not ok:
                picks[i] = None
    return picks


def _processed(raw: torch.Tensor, rows: Sequence, eos_ids: Iterable[int], copy: bool) -> torch.Tensor:
    """`raw` with each row through `process_logits`: `raw` itself when no row changes and no `copy` is asked."""
    changed = [i for i, row in enumerate(rows) if _processes(row.sampling, len(row.output_token_ids))]
    if not changed and not copy:
        return raw
    logits = raw.clone()
    for i in changed:
        row = rows[i]
        logits[i] = process_logits(raw[i], row.sampling, row.prompt_token_ids, row.output_token_ids, eos_ids,
                                   counts=_penalty_counts(row, raw.shape[-1], raw.device))
    return logits


def _penalty_counts(row, vocab_size: int, device: torch.device) -> PenaltyCounts | None:
    """The row's PenaltyCounts brought up to date, if it keeps one (a Sequence does); None: recount."""
    if not row.sampling.has_penalties or not hasattr(row, "penalties"):
        return None
    if row.penalties is None:
        row.penalties = PenaltyCounts(row.prompt_token_ids, vocab_size, device)
    return row.penalties.update(row.output_token_ids)


def _with_logprobs(raw: torch.Tensor, rows: Sequence, tokens: list[int | None]) -> list[Pick | None]:
    """Each chosen token with its logprobs where its row asked for them (`batch_logprobs` over those rows)."""
    picks: list[Pick | None] = [None if token is None else (token, None) for token in tokens]
    wanted = [i for i, row in enumerate(rows) if row.sampling.return_logprobs and tokens[i] is not None]
    if wanted:
        logprobs = batch_logprobs(raw[wanted], [tokens[i] for i in wanted],
                                  [rows[i].sampling.top_logprobs for i in wanted])
        for i, lp in zip(wanted, logprobs):
            picks[i] = (tokens[i], lp)
    return picks


def _mask_guided(raw: torch.Tensor, rows: Sequence, guided: list[int], logits: torch.Tensor,
                 eos_ids: Iterable[int], masks) -> set[int]:
    """Mask the guided rows of `logits` (a copy of `raw`) in place; return the rows whose matcher failed."""
    matchers = [rows[i].matcher for i in guided]
    banned = masks.banned(matchers).to(logits.device)
    stacked = logits[guided]
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
                                  ban_early_stops=False, counts=_penalty_counts(row, raw.shape[-1], raw.device))
            stacked[j] = redo.masked_fill(banned[j], float("-inf"))
    logits[guided] = stacked
    return failed
