"""Stage 4 of the sampler: one token per row by inverse CDF, from one uniform number per row.

The token is the first id, in id order, at which the running sum of the kept tokens' weights
exp(logit - max) reaches u * their total. One number per row (rather than the V exponentials
per row of an exponential race, argmax p / E) keeps a seeded row's draw a function of its own
logits, parameters and generator alone, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yaie.sampling.weights import exp_weights

# Tokens per chunk of the two-level inverse CDF of the full-row draw (see draw_full_rows).
DRAW_CHUNK = 512


def uniforms(
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


def draw_full_rows(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of weights [n, V] (unnormalised probabilities, the row's maximum 1,
    cut tokens 0), by inverse CDF in token-id order.

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
    chunk_sums = weights[:, : num_full * chunk].reshape(num_rows, num_full, chunk).sum(dim=-1)
    if vocab % chunk:
        chunk_sums = torch.cat([chunk_sums, weights[:, num_full * chunk :].sum(dim=-1, keepdim=True)], dim=1)
    chunk_cdf = chunk_sums.cumsum(dim=-1, dtype=torch.float64)
    # The target lies in (0, total] (total >= 1), so the first chunk (and then the first token)
    # whose running sum reaches it has non-zero weight.
    target = uniforms(num_rows, generators, device) * chunk_cdf[:, -1]
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


def draw_from_candidates(
    values: torch.Tensor,
    ids: torch.Tensor,
    threshold: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The same draw when each row's kept tokens are all among its truncation candidates
    (values, ids [n, W], largest first; kept: values >= threshold [n]): the same inverse CDF in
    token-id order as draw_full_rows, over W tokens rather than V. The two give the same token
    for the same u, up to float rounding at a boundary (~1e-7)."""
    vocab_end = torch.iinfo(ids.dtype).max
    kept = values >= threshold.unsqueeze(1)
    # Kept candidates in id order (cut ones sort last), as the full-row draw would meet them.
    order = torch.where(kept, ids, vocab_end).argsort(dim=-1)
    row_max = values[:, :1]
    weights = torch.where(kept, exp_weights(values, row_max), 0.0).gather(1, order)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms(values.shape[0], generators, values.device) * cdf[:, -1]
    position = torch.searchsorted(cdf, target.unsqueeze(1)).clamp_max_(values.shape[1] - 1)
    return ids.gather(1, order.gather(1, position)).squeeze(1)
