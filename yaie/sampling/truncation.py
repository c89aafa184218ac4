"""Stage 3 of the sampler: top_k, then top_p, then min_p, as one logit threshold per row.

Each cut is a logit threshold and a row keeps the logits >= the largest of its thresholds, so
tokens tied with the last one kept are all kept; this makes the kept set independent of the
order in which a sort happens to put equal values (bf16 logits tie often). The cut-offs are
found with ``topk`` over a few candidates rather than a full sort of the vocabulary whenever
that can be proven exact; the candidates are kept, for the draw and the logprobs to reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yaie.sampling.weights import logsumexp

NEG_INF = float("-inf")
# Candidates taken (with topk) per row to look for the top_p cut-off in rows without top_k.
# Rows whose nucleus is larger fall back to a full sort of the vocabulary: exact, but far
# costlier than a topk this wide on a CPU (benchmarks/sampler.py, "top-p only").
TOP_P_PROBE = 256


@dataclass
class Cut:
    """The truncation of a batch of temperature-scaled logits [n, V]."""

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
        row_log_z = torch.where(has_k, row_log_z, logsumexp(logits) if log_z is None else log_z)
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


@dataclass
class Truncation:
    """Per row of the batch: ``top_k`` (-1 or 0: off), then ``top_p`` over the
    top-k-renormalised distribution (the shortest run of most likely tokens whose mass reaches
    top_p), then ``min_p`` (keep tokens with prob >= min_p * max prob)."""

    top_k: list[int]
    top_p: list[float]
    min_p: list[float]

    def needs_log_z(self, vocab_size: int) -> bool:
        """Whether a row has top_p without an effective top_k, whose nucleus is measured
        against the whole row's normaliser (which the caller may then pass to `cut`)."""
        return any(p < 1.0 and not 0 < k < vocab_size for k, p in zip(self.top_k, self.top_p, strict=True))

    def cut(self, logits: torch.Tensor, log_z: torch.Tensor | None = None) -> Cut:
        """The cut of temperature-scaled logits [n, V]: per row, the smallest logit that
        survives top_k, then top_p, then min_p. ``log_z`` optionally gives the rows'
        logsumexp, if already known."""
        num_rows, vocab = logits.shape
        top_k = [k if 0 < k < vocab else 0 for k in self.top_k]
        top_p, min_p = self.top_p, self.min_p
        threshold: torch.Tensor | None = None
        if any(m > 0.0 for m in min_p):
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf: no cut.
            min_p_t = torch.tensor(min_p, dtype=logits.dtype, device=logits.device)
            threshold = logits.amax(dim=-1) + min_p_t.log()
        rows = [r for r in range(num_rows) if top_k[r] or top_p[r] < 1.0]
        if not rows:
            return Cut(threshold, rows)
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
        return Cut(threshold, rows, values, ids, fits)
