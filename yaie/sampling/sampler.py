"""Turn a batch of next-token logits into sampled token ids, one request per row.

The work is vectorised over the batch: per-request parameters are gathered into [B] tensors
(or flat index lists, for the sparse ones) and no tensor operation runs per row, except taking
the random number of each seeded request from its own generator. Each step, in this order:

1. ``logit_bias`` is added. Token ids outside the vocabulary are ignored here: the sampler cannot
   reject one request without failing the whole batch, so such ids should be refused when the
   request is added, where the vocabulary size is known. Then, while a request has fewer than
   ``min_tokens`` output tokens, its ``stop_token_ids`` and (unless ``ignore_eos``) the model's
   EOS ids are banned (set to -inf) after the bias, so that no bias can lift the ban.
2. Penalties. ``repetition_penalty`` as in HF/vLLM: for every token seen in the prompt or the
   output, a positive logit is divided by the penalty and any other is multiplied by it. Then
   ``frequency_penalty`` and ``presence_penalty`` as in OpenAI, over the output tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
   Steps 1-2 are `process_logits`; the result is the "processed logits".
3. Greedy rows (temperature 0) take the argmax of the processed logits (lowest id on ties).
4. Other rows are divided by their temperature and then truncated: ``top_k`` (-1 or 0: off),
   then ``top_p`` over the top-k-renormalised distribution (the shortest run of most likely
   tokens whose mass reaches top_p), then ``min_p`` (keep tokens with prob >= min_p * max prob).
   Each cut is a logit threshold and a row keeps the logits >= the largest of its thresholds,
   so tokens tied with the last one kept are all kept; this makes the kept set independent of
   the order in which a sort happens to put equal values (bf16 logits tie often). See
   `truncation_thresholds`, which finds the cut-offs with ``topk`` over a few candidates rather
   than a full sort of the vocabulary whenever it can.
5. Draw, by inverse CDF: one uniform number u per row, and the token is the first id, in id
   order, at which the running sum of the kept tokens' weights exp(logit - max) reaches
   u * their total. When every sampled row keeps only tokens among the candidates its top_k /
   top_p search ranked, the sums run over those few candidates (put back in id order);
   otherwise over full rows, in chunks. Both give the same token for the same u (up to float
   rounding at a boundary, ~1e-7). A row with a ``generator`` (a seeded request) takes its u
   from it, the others from the global RNG; so a row's token depends only on its own logits,
   parameters and u, and a seed gives the same tokens whatever else is in the batch and at
   whatever row. One number per row also replaces the V exponentials per row that an
   exponential race (argmax p / E) needs: those alone take ~20 ms at 32 x 49,152 on a CPU.
6. Logprobs, for rows that asked: log_softmax of the processed logits divided by the row's
   temperature (1 for greedy rows), taken before the truncation of step 4 so that every
   alternative has a finite value (the distribution actually drawn from is this one
   renormalised over the kept tokens). ``top_logprobs`` are sorted best first, as many per row
   as the row asked for (found once, with the batch's largest ``logprobs``).

When every row is greedy with nothing to apply (no bias, penalties, active min_tokens or
logprobs), the step is a single argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from yaie.outputs import TokenLogprob
from yaie.sampling_params import SamplingParams

NEG_INF = float("-inf")
# Candidates taken (with topk) per row to look for the top_p cut-off in rows without top_k.
# Rows whose nucleus is larger fall back to a full sort of the vocabulary: exact, but ~25x the
# cost of a topk this wide on a CPU.
TOP_P_PROBE = 256
# exp() of anything below this gives a subnormal or zero float32, which took up to 30x longer
# than normal values on the x86 CPU this was measured on (low temperatures make such logits
# common). Logits further than this below the row's maximum have odds under 1e-37 that no
# float64 running sum can resolve, so flooring their exponent here changes no draw.
EXP_FLOOR = -87.0
# Tokens per chunk of the two-level inverse CDF of the draw (see _draw_full_rows).
DRAW_CHUNK = 512
# Prompt positions per log_softmax in prompt_logprobs, to bound the extra memory to a slice.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class SamplingSeq:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # set for requests with a seed


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Present only when some row asked for logprobs: per row, the sampled token's logprob and
    # the top alternatives as (token id, logprob), best first, as many as that row asked for.
    # Rows that did not ask hold nan and [].
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


def _min_tokens_bans(seq: SamplingSeq, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids this row may not produce yet because of min_tokens."""
    params = seq.params
    if len(seq.output_token_ids) >= params.min_tokens:
        return []
    # With ignore_eos, EOS does not end the request, so there is nothing to hold back.
    return params.stop_token_ids if params.ignore_eos else [*params.stop_token_ids, *eos_token_ids]


def _flat_index(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """row * vocab_size + token id for every token of every row, as one index into a [B*V] view."""
    lengths = [len(ids) for ids in token_lists]
    # numpy reads a chain of Python ints ~8x faster than torch.tensor does, which matters for
    # penalties over long prompts.
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    rows = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
    return torch.from_numpy(rows * vocab_size + ids).to(device)


def _apply_penalties_(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
    """Step 2, in place on logits [B, V].

    Only the entries of tokens a row has seen change, so the work is done on those entries
    (gathered through a flat index) rather than on [B, V] tensors of counts and masks: the
    penalties then cost about as much as the history is long, not as much as the vocabulary.
    """
    vocab = logits.shape[1]
    device, dtype = logits.device, logits.dtype
    flat = logits.view(-1)
    params = [seq.params for seq in seqs]
    penalised = [_has_penalty(p) for p in params]
    outputs = [seq.output_token_ids if pen else [] for seq, pen in zip(seqs, penalised, strict=True)]
    # One entry per distinct (row, output token), with how often the row produced it.
    seen_output, counts = torch.unique(_flat_index(outputs, vocab, device), return_counts=True)

    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        # Only rows with a repetition penalty need their prompt, which can be long.
        prompts = [seq.prompt_token_ids if r != 1.0 else [] for seq, r in zip(seqs, repetition, strict=True)]
        # Repeated entries are harmless: each copy reads the same old value and writes the
        # same new one.
        seen = torch.cat([_flat_index(prompts, vocab, device), seen_output])
        penalty = torch.tensor(repetition, dtype=dtype, device=device)[seen // vocab]
        old = flat[seen]
        flat[seen] = torch.where(old > 0, old / penalty, old * penalty)

    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        row = seen_output // vocab
        flat[seen_output] -= frequency[row] * counts.to(dtype) + presence[row]


def _process_logits_(logits: torch.Tensor, seqs: Sequence[SamplingSeq], eos_token_ids: Sequence[int]) -> bool:
    """Steps 1-2, in place on float32 logits [B, V]; says whether some token was banned (-inf)."""
    vocab = logits.shape[1]
    bias_index: list[int] = []
    bias_value: list[float] = []
    ban_index: list[int] = []
    for row, seq in enumerate(seqs):
        base = row * vocab
        for token_id, bias in seq.params.logit_bias.items():
            if token_id < vocab:
                bias_index.append(base + token_id)
                bias_value.append(bias)
        ban_index.extend(base + t for t in _min_tokens_bans(seq, eos_token_ids) if t < vocab)
    flat = logits.view(-1)
    if bias_index:
        index = torch.tensor(bias_index, device=logits.device)
        flat.index_add_(0, index, torch.tensor(bias_value, dtype=logits.dtype, device=logits.device))
    if ban_index:
        flat.index_fill_(0, torch.tensor(ban_index, device=logits.device), NEG_INF)
    if any(_has_penalty(seq.params) for seq in seqs):
        _apply_penalties_(logits, seqs)
    return bool(ban_index)


def process_logits(
    logits: torch.Tensor, seqs: Sequence[SamplingSeq], eos_token_ids: Iterable[int] = ()
) -> torch.Tensor:
    """Steps 1-2 of the module docstring (logit_bias, min_tokens bans, then penalties) on a
    float32 copy of logits [B, V], row i belonging to seqs[i]; ``logits`` is left untouched."""
    out = logits.to(torch.float32, copy=True)
    _process_logits_(out, seqs, tuple(eos_token_ids))
    return out


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp of logits [n, V], with exponents floored at EXP_FLOOR."""
    row_max = logits.amax(dim=-1, keepdim=True)
    weights = torch.clamp(logits, min=row_max + EXP_FLOOR).sub_(row_max).exp_()
    return row_max.squeeze(1) + weights.sum(dim=-1).log()


def _exp_weights(
    logits: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """exp(logits - row_max) with the exponent floored at EXP_FLOOR; row_max is [n, 1].

    The draw computes these weights both over full rows and over top-k candidates; one formula
    keeps the two bit-identical."""
    return torch.clamp(logits, min=row_max + EXP_FLOOR, out=out).sub_(row_max).exp_()


@dataclass
class _Cut:
    """Step 4's result for a batch of temperature-scaled logits [n, V]."""

    threshold: torch.Tensor | None  # [n]: keep logits >= it (-inf: no cut); None: no row is cut
    rows: list[int]  # the rows with top_k or top_p, for which topk found candidates:
    values: torch.Tensor | None = None  # [len(rows), W] their largest logits, descending
    ids: torch.Tensor | None = None  # [len(rows), W] the candidates' token ids
    fits: torch.Tensor | None = None  # [len(rows)] whether the row's kept set is all candidates


def _top_k_top_p(
    logits: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    log_z: torch.Tensor | None = None,
    full_sort: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logit threshold of top_k then top_p per row of logits [n, V] (top_k 0: off), with
    the candidates it was found among (values and ids, largest first).

    Works on the ``width`` largest logits of each row, found with topk: one past the largest k,
    and at least TOP_P_PROBE when a row has top_p without top_k. Rows whose cut-off cannot be
    proven from those candidates get their threshold from a full sort. ``log_z``, the rows'
    logsumexp, is computed here if a top_p row without top_k needs it and it is not given.
    """
    vocab = logits.shape[1]
    uses_p = [p < 1.0 for p in top_p]
    if full_sort:
        width = vocab
    else:
        # One past the largest k shows whether the k-th value ties with values beyond it, i.e.
        # whether the kept set lies within the candidates.
        width = max(top_k) + 1
        if any(p and not k for k, p in zip(top_k, uses_p, strict=True)):
            width = max(width, TOP_P_PROBE)
        width = min(width, vocab)
    if width == vocab:
        values, ids = logits.sort(dim=-1, descending=True)
    else:
        values, ids = logits.topk(width, dim=-1)  # sorted, largest first

    device = logits.device
    k = torch.tensor(top_k, device=device)
    has_k = k > 0
    kth = values.gather(1, (k - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    threshold = torch.where(has_k, kth, NEG_INF)
    if not any(uses_p):
        return threshold, values, ids

    kept_by_k = values >= threshold.unsqueeze(1)
    # The log-normaliser of the top-k-truncated distribution: over the candidates for top_k
    # rows (checked below to hold their whole top-k set), over the full row otherwise.
    row_log_z = torch.where(kept_by_k, values, NEG_INF).logsumexp(dim=-1)
    if not all(k_ for k_, p in zip(top_k, uses_p, strict=True) if p):
        row_log_z = torch.where(has_k, row_log_z, _logsumexp(logits) if log_z is None else log_z)
    probs = torch.where(kept_by_k, (values - row_log_z.unsqueeze(1)).exp(), 0.0)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device)
    # Keep a token while the mass of the tokens before it is still short of top_p; the first
    # token always qualifies, so num_kept >= 1.
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < p.unsqueeze(1)).sum(dim=-1)
    cut = values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    uses_p_t = p < 1.0
    threshold = torch.where(uses_p_t, torch.maximum(threshold, cut), threshold)

    if width < vocab:
        # A top_k row's normaliser needs its whole top-k set among the candidates (ties with
        # the k-th value may reach past them); a top_p-only row needs its cut-off found before
        # the last candidate.
        unsafe = uses_p_t & torch.where(has_k, values[:, -1] >= kth, num_kept >= width)
        redo = unsafe.nonzero().squeeze(1).tolist()
        if redo:
            rows = torch.tensor(redo, device=device)
            threshold[rows] = _top_k_top_p(
                logits[rows],
                [top_k[r] for r in redo],
                [top_p[r] for r in redo],
                None if log_z is None else log_z[rows],
                full_sort=True,
            )[0]
    return threshold, values, ids


def _truncate(
    logits: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    log_z: torch.Tensor | None = None,
) -> _Cut:
    """Step 4 for temperature-scaled logits [n, V]; see truncation_thresholds."""
    num_rows, vocab = logits.shape
    top_k = [k if 0 < k < vocab else 0 for k in top_k]
    threshold: torch.Tensor | None = None
    if any(m > 0.0 for m in min_p):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf: no cut.
        min_p_t = torch.tensor(min_p, dtype=logits.dtype, device=logits.device)
        threshold = logits.amax(dim=-1) + min_p_t.log()
    rows = [r for r in range(num_rows) if top_k[r] or top_p[r] < 1.0]
    if not rows:
        return _Cut(threshold, rows)
    if threshold is None:
        threshold = logits.new_full((num_rows,), NEG_INF)
    if len(rows) == num_rows:
        cut, values, ids = _top_k_top_p(logits, top_k, list(top_p), log_z)
        threshold = torch.maximum(threshold, cut)
        row_threshold = threshold
    else:
        index = torch.tensor(rows, device=logits.device)
        cut, values, ids = _top_k_top_p(
            logits.index_select(0, index),
            [top_k[r] for r in rows],
            [top_p[r] for r in rows],
            None if log_z is None else log_z[index],
        )
        row_threshold = torch.maximum(threshold[index], cut)
        threshold[index] = row_threshold
    # Every kept logit is a candidate when the smallest candidate is below the threshold.
    fits = (
        values[:, -1] < row_threshold
        if values.shape[1] < vocab
        else torch.ones_like(row_threshold, dtype=torch.bool)
    )
    return _Cut(threshold, rows, values, ids, fits)


def truncation_thresholds(
    logits: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    log_z: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Step 4's cut-offs: per row of temperature-scaled logits [n, V], the smallest logit that
    survives top_k, then top_p, then min_p, as an [n] tensor (-inf: no cut), or None when no
    row is cut at all. ``log_z`` optionally gives the rows' logsumexp, if already known."""
    return _truncate(logits, top_k, top_p, min_p, log_z).threshold


def _uniforms(
    num_rows: int, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """One float64 uniform in (0, 1] per row: from the row's generator where it has one (a
    seeded request: exactly one number per step, whatever the batch), else the global RNG."""
    if all(g is not None for g in generators):
        u = torch.empty(num_rows, dtype=torch.float64, device=device)
    else:
        u = torch.rand(num_rows, dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)[0]
    return 1.0 - u  # rand is in [0, 1)


def _draw_full_rows(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Step 5 over full rows: one token id per row of weights [n, V] (unnormalised
    probabilities, the row's maximum 1), by inverse CDF in token-id order.

    The inverse CDF runs in two levels so that no [n, V] running sum is needed: the sums of
    DRAW_CHUNK-token chunks pick the chunk, then a float64 running sum over that chunk alone
    picks the token. A float32 running sum over the whole vocabulary would instead round the
    odds of every token below ~1e-7 of the total to zero or to one rounding step.
    """
    num_rows, vocab = weights.shape
    device = weights.device
    chunk = min(DRAW_CHUNK, vocab)
    num_full = vocab // chunk
    # float32 sums (pairwise, so each within ~1e-7 relative) avoid a float64 copy of the
    # weights; a chunk's odds are then off by at most that factor.
    chunk_sums = weights[:, : num_full * chunk].unflatten(1, (num_full, chunk)).sum(dim=-1)
    if vocab % chunk:
        chunk_sums = torch.cat([chunk_sums, weights[:, num_full * chunk :].sum(dim=-1, keepdim=True)], dim=1)
    chunk_cdf = chunk_sums.cumsum(dim=-1, dtype=torch.float64)
    # The target lies in (0, total] (total >= 1), so the first chunk (and then the first token)
    # whose running sum reaches it has non-zero weight.
    target = _uniforms(num_rows, generators, device) * chunk_cdf[:, -1]
    chosen = torch.searchsorted(chunk_cdf, target.unsqueeze(1)).clamp_max_(chunk_cdf.shape[1] - 1)
    before = torch.where(chosen > 0, chunk_cdf.gather(1, (chosen - 1).clamp_min(0)), 0.0).squeeze(1)

    start = chosen * chunk  # [n, 1]
    positions = start + torch.arange(chunk, device=device)
    inside = positions < vocab  # the tail chunk may be shorter
    chunk_weights = torch.where(inside, weights.gather(1, positions.clamp_max(vocab - 1)), 0.0)
    cdf = chunk_weights.cumsum(dim=-1, dtype=torch.float64)
    # The chunk's own running sum may round a hair differently from its float32 sum: keep the
    # rest of the target within (0, chunk total].
    rest = torch.minimum(target - before, cdf[:, -1])
    offset = torch.searchsorted(cdf, rest.unsqueeze(1)).clamp_max_(chunk - 1)
    return (start + offset).squeeze(1)


def _draw_from_candidates(
    values: torch.Tensor,
    ids: torch.Tensor,
    threshold: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Step 5 when each row's kept tokens are all among its candidates (values, ids [n, W],
    largest first): the same inverse CDF in token-id order as _draw_full_rows, over W tokens, not V."""
    vocab_end = torch.iinfo(ids.dtype).max
    kept = values >= threshold.unsqueeze(1)
    # Kept candidates in id order (cut ones sort last), as the full-row draw would meet them.
    order = torch.where(kept, ids, vocab_end).argsort(dim=-1)
    row_max = values[:, :1]
    weights = torch.where(kept, _exp_weights(values, row_max), 0.0).gather(1, order)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = _uniforms(values.shape[0], generators, values.device) * cdf[:, -1]
    position = torch.searchsorted(cdf, target.unsqueeze(1)).clamp_max_(values.shape[1] - 1)
    return ids.gather(1, order.gather(1, position)).squeeze(1)


class _Workspace:
    """[rows, V] buffers kept from step to step. On a CPU a fresh multi-megabyte tensor per
    operation is paid for in page faults, which cost as much as the arithmetic here."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = like.shape
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.shape[0] < rows
            or buffer.shape[1] != cols
            or buffer.dtype != dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(rows, cols, dtype=dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:rows]


class Sampler:
    """``Sampler(eos_token_ids)(logits [B, V], seqs) -> SamplerOutput``, row i for seqs[i].

    Keeps a few [B, V] work buffers between calls (see _Workspace), sized by the largest batch
    seen: about 9 bytes per logit, e.g. 14 MB at batch 32 over 49,152 tokens.
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        # EOS ids are banned, like stop_token_ids, while a request is short of min_tokens.
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self._workspace = _Workspace()

    def _is_plain_greedy(self, seq: SamplingSeq) -> bool:
        params = seq.params
        return (
            params.greedy
            and params.logprobs is None
            and not params.logit_bias
            and not _has_penalty(params)
            and not _min_tokens_bans(seq, self.eos_token_ids)
        )

    @torch.inference_mode()  # nothing here needs autograd; its buffers stay inference tensors
    def __call__(self, logits: torch.Tensor, seqs: list[SamplingSeq]) -> SamplerOutput:
        if all(self._is_plain_greedy(seq) for seq in seqs):
            return SamplerOutput(logits.argmax(dim=-1).tolist())

        device = logits.device
        params = [seq.params for seq in seqs]
        # One working copy, processed in place from here on (the caller's logits stay intact).
        work = self._workspace.get("logits", logits, torch.float32).copy_(logits)
        banned = _process_logits_(work, seqs, self.eos_token_ids)
        # Greedy rows are scaled by 1: their argmax is unchanged and their logprobs are those
        # of the processed logits.
        temperatures = [p.temperature or 1.0 for p in params]
        if any(t != 1.0 for t in temperatures):
            work.div_(torch.tensor(temperatures, dtype=work.dtype, device=device).unsqueeze(1))

        greedy = [p.greedy for p in params]
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        # Greedy rows are neither cut nor drawn for (nor do they use their generator).
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]

        # The rows' log-normaliser, for logprobs and for top_p without top_k, comes with the
        # full-row weights exp(logit - row max), which the draw may need as well.
        weights: torch.Tensor | None = None
        log_z: torch.Tensor | None = None
        vocab = work.shape[1]
        if logprob_rows or any(p < 1.0 and not 0 < k < vocab for k, p in zip(top_k, top_p, strict=True)):
            weights = self._full_row_weights(work)
            log_z = work.amax(dim=-1) + weights.sum(dim=-1).log()

        token_ids = work.argmax(dim=-1) if any(greedy) else None
        cut: _Cut | None = None
        if not all(greedy):
            cut = _truncate(work, top_k, top_p, min_p, log_z)
            generators = [None if g else seq.generator for seq, g in zip(seqs, greedy, strict=True)]
            drawn = self._draw_batch(work, weights, cut, banned, greedy, generators)
            greedy_t = torch.tensor(greedy, device=device)
            token_ids = drawn if token_ids is None else torch.where(greedy_t, token_ids, drawn)

        assert token_ids is not None
        output = SamplerOutput(token_ids.tolist())
        if logprob_rows:
            assert log_z is not None
            top = self._top_logprobs(work, log_z, logprob_rows, params, cut)
            chosen = (work.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_z).tolist()
            output.logprobs = [float("nan")] * len(seqs)
            output.top_logprobs = [[] for _ in seqs]
            for row, alternatives in zip(logprob_rows, top, strict=True):
                output.logprobs[row] = chosen[row]
                output.top_logprobs[row] = alternatives
        return output

    # Interim bridge to the staged interface (prepare + sample) the engine now calls.
    def prepare(self, seqs: Sequence, device: torch.device) -> list[SamplingSeq]:
        return [
            SamplingSeq(s.sampling_params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in seqs
        ]

    def sample(self, logits: torch.Tensor, batch: list[SamplingSeq]) -> SamplerOutput:
        if not batch:
            return SamplerOutput([])
        out = self(logits, batch)
        if out.logprobs is not None and out.top_logprobs is not None:
            out.logprobs = [  # type: ignore[assignment]
                TokenLogprob(t, lp, top) if batch[i].params.logprobs is not None else None
                for i, (t, lp, top) in enumerate(
                    zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
                )
            ]
        return out

    def _full_row_weights(self, work: torch.Tensor) -> torch.Tensor:
        weights = self._workspace.get("weights", work, work.dtype)
        return _exp_weights(work, work.amax(dim=-1, keepdim=True), out=weights)

    def _draw_batch(
        self,
        work: torch.Tensor,
        weights: torch.Tensor | None,
        cut: _Cut,
        banned: bool,
        greedy: list[bool],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Step 5 for the batch (greedy rows get a token too, which the caller ignores)."""
        threshold = cut.threshold
        if banned:
            # Floored weights are never quite 0: cut the banned (-inf) logits explicitly.
            lowest = torch.finfo(work.dtype).min
            threshold = (
                work.new_full((len(greedy),), lowest) if threshold is None else threshold.clamp_min(lowest)
            )
        if cut.fits is not None and len(cut.rows) == greedy.count(False) and bool(cut.fits.all()):
            # Every sampled row keeps only some of its top candidates: draw among those.
            assert threshold is not None and cut.values is not None and cut.ids is not None
            index = torch.tensor(cut.rows, device=work.device)
            drawn = torch.zeros(len(greedy), dtype=torch.long, device=work.device)
            drawn[index] = _draw_from_candidates(
                cut.values, cut.ids, threshold[index], [generators[r] for r in cut.rows]
            )
            return drawn
        if weights is None:
            weights = self._full_row_weights(work)
        if threshold is not None:
            mask = self._workspace.get("mask", work, torch.bool)
            weights.masked_fill_(torch.lt(work, threshold.unsqueeze(1), out=mask), 0.0)
        return _draw_full_rows(weights, generators)

    @staticmethod
    def _top_logprobs(
        scaled: torch.Tensor,
        log_z: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        cut: _Cut | None,
    ) -> list[list[tuple[int, float]]]:
        """Step 6's alternatives for the given rows: the top logprobs = scaled - log_z, best
        first, as many as each row asked for (one topk with the largest)."""
        k = min(max(params[r].logprobs or 0 for r in rows), scaled.shape[1])
        if k == 0:
            return [[] for _ in rows]
        device = scaled.device
        index = torch.tensor(rows, device=device)
        candidate_of = {row: i for i, row in enumerate(cut.rows)} if cut is not None else {}
        if (
            cut is not None
            and cut.values is not None
            and cut.ids is not None
            and k <= cut.values.shape[1]
            and all(r in candidate_of for r in rows)
        ):
            # Truncation already ranked these rows' largest logits: no second topk.
            at = torch.tensor([candidate_of[r] for r in rows], device=device)
            values, ids = cut.values.index_select(0, at)[:, :k], cut.ids.index_select(0, at)[:, :k]
        elif len(rows) < scaled.shape[0]:
            values, ids = scaled.index_select(0, index).topk(k, dim=-1)  # sorted, best first
        else:
            values, ids = scaled.topk(k, dim=-1)
        values = values - log_z[index].unsqueeze(1)
        return [
            list(zip(row_ids[: params[r].logprobs], row_values[: params[r].logprobs], strict=True))
            for r, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True)
        ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Logprobs of a prompt's own tokens, for ``echo`` with logprobs.

    ``logits`` [P-1, V] are the raw logits at prompt positions 0..P-2 and ``next_token_ids``
    [P-1] the prompt tokens 1..P-1 they predict. Returns, per position, the log_softmax of the
    raw logits (no penalties or temperature) at the actual next token and the top ``k``
    alternatives, best first.
    """
    next_ids = torch.as_tensor(next_token_ids, dtype=torch.long)
    result: list[TokenLogprob] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK):
        stop = start + PROMPT_LOGPROBS_CHUNK
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        ids = next_ids[start:stop].to(logprobs.device)
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        width = min(k, logprobs.shape[1])
        if width > 0:
            values, top_ids = logprobs.topk(width, dim=-1)
            pairs = zip(top_ids.tolist(), values.tolist(), strict=True)
            tops = [list(zip(i, v, strict=True)) for i, v in pairs]
        else:
            tops = [[] for _ in chosen]
        result.extend(TokenLogprob(t, lp, top) for t, lp, top in zip(ids.tolist(), chosen, tops, strict=True))
    return result
