"""Stage 5 of the sampler (logprobs of the sampled tokens), and the prompt's own logprobs."""

from __future__ import annotations

import torch

from yaie.outputs import TokenLogprob
from yaie.sampling.truncation import Cut

# Prompt positions per log_softmax in prompt_logprobs, to bound the extra memory to a slice.
PROMPT_LOGPROBS_CHUNK = 512


def _top(
    scaled: torch.Tensor, log_z: torch.Tensor, rows: list[int], ks: list[int], cut: Cut | None
) -> list[list[tuple[int, float]]]:
    """The top logprobs (scaled - log_z) of the given rows, best first, ks[i] of them for
    rows[i]: one topk with the largest k, or none where truncation already ranked the rows."""
    k = min(max(ks), scaled.shape[1])
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
        list(zip(row_ids[:row_k], row_values[:row_k], strict=True))
        for row_k, row_ids, row_values in zip(ks, ids.tolist(), values.tolist(), strict=True)
    ]


def token_logprobs(
    scaled: torch.Tensor,
    log_z: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: list[int | None],
    cut: Cut | None,
) -> list[TokenLogprob | None]:
    """Per row of the processed, temperature-scaled logits [B, V] (log_z [B] their
    logsumexp): the sampled token's logprob with the row's ``num_top[row]`` best alternatives,
    or None for the rows whose num_top is None. ``cut`` is the batch's truncation, whose
    candidates serve as the alternatives when they are enough."""
    rows = [row for row, k in enumerate(num_top) if k is not None]
    ks = [num_top[row] or 0 for row in rows]
    top = _top(scaled, log_z, rows, ks, cut)
    chosen = (scaled.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_z).tolist()
    token_list = token_ids.tolist()
    result: list[TokenLogprob | None] = [None] * len(num_top)
    for row, alternatives in zip(rows, top, strict=True):
        result[row] = TokenLogprob(token_list[row], chosen[row], alternatives)
    return result


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
