"""Verification: which of a sequence's draft tokens the target model keeps, and the token after.

The target scored the sequence's last token followed by its k draft tokens in one forward, so
it has logits rows [k+1, V]: row j is its prediction for the position of draft j (row k, for
the position after the last draft). Each row is turned into the distribution the sampler would
draw from at that position (`processed_distribution`): the same logit_bias, min_tokens bans,
penalties, temperature and top-k / top-p / min-p, with the history that position would have
(the output so far plus the drafts before it).

Greedy requests keep the longest run of drafts that equal the target's argmax, then take the
target's argmax after it: token for token what decoding without drafts gives. Sampled requests
use rejection sampling: draft j, drawn from the proposer's distribution q, is kept with
probability min(1, p/q), where p is the target's; at the first rejection the token is drawn
from max(p - q, 0), normalised, and if every draft is kept one more is drawn from the last
row. Each emitted token is then distributed exactly as the target's own draw would be, whatever
q is. A proposer that drafts deterministically (an n-gram lookup) has q = a point mass.

Logprobs are the target's, defined as the sampler defines them: the log_softmax of the
processed logits over the temperature, before truncation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from yaie.outputs import TokenLogprob
from yaie.sampling.sampler import SamplerOutput, SamplingSeq, process_logits, truncation_thresholds
from yaie.sampling_params import SamplingParams


@dataclass
class Draft:
    """A proposer's guess at a sequence's next tokens."""

    token_ids: list[int]
    # [len(token_ids), V]: the distribution each token was drawn from; None when the proposer
    # picks its tokens deterministically (q is then a point mass on each token).
    probs: torch.Tensor | None = None


@dataclass
class Verified:
    token_ids: list[int]  # the kept drafts, then one token from the target
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked
    num_accepted: int  # how many of the draft's tokens were kept


def processed_distribution(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: Iterable[list[int]],
    eos_token_ids: Iterable[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampler's view of logits rows [n, V] of one sequence, row i with output history
    output_token_ids[i]: (the processed logits over the temperature [n, V], float32, and the
    probabilities drawn from after truncation [n, V], or None for a greedy request)."""
    rows = [SamplingSeq(params, prompt_token_ids, list(output)) for output in output_token_ids]
    processed = process_logits(logits, rows, eos_token_ids)
    if params.greedy:
        return processed, None
    scaled = processed.div_(params.temperature)
    n = scaled.shape[0]
    threshold = truncation_thresholds(scaled, [params.top_k] * n, [params.top_p] * n, [params.min_p] * n)
    kept = scaled if threshold is None else scaled.masked_fill(scaled < threshold.unsqueeze(1), float("-inf"))
    return scaled, torch.softmax(kept, dim=-1)


def verify(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    eos_token_ids: Iterable[int],
    generator: torch.Generator | None = None,
) -> Verified:
    """Check `draft` (k tokens) against the target's logits rows [k+1, V] for one sequence whose
    tokens so far are prompt + output; `generator` is the seeded request's, if any."""
    drafted = draft.token_ids
    histories = [output_token_ids + drafted[:j] for j in range(len(drafted) + 1)]
    scaled, probs = processed_distribution(logits, params, prompt_token_ids, histories, eos_token_ids)
    return decide(scaled, probs, draft, params, generator)


def decide(
    scaled: torch.Tensor,
    probs: torch.Tensor | None,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verified:
    """`verify` given the target's rows as `processed_distribution` makes them (with each
    row's history including the drafts before it)."""
    drafted = draft.token_ids
    k = len(drafted)
    if probs is None:
        best = scaled.argmax(dim=-1).tolist()  # lowest id on ties, as the sampler
        accepted = 0
        while accepted < k and best[accepted] == drafted[accepted]:
            accepted += 1
        token_ids = [*drafted[:accepted], best[accepted]]
    else:
        accepted, last = _rejection_sample(probs, draft, generator)
        token_ids = [*drafted[:accepted], last]
    logprobs = None
    if params.logprobs is not None:
        logprobs = _logprobs(scaled[: len(token_ids)], token_ids, params.logprobs)
    return Verified(token_ids, logprobs, accepted)


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    gen_device = generator.device if generator is not None else device
    return float(torch.rand(1, dtype=torch.float64, generator=generator, device=gen_device)[0])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def _rejection_sample(
    probs: torch.Tensor, draft: Draft, generator: torch.Generator | None
) -> tuple[int, int]:
    """(drafts kept, the token after them) by rejection sampling; probs are the target's [k+1, V]."""
    for j, token in enumerate(draft.token_ids):
        p = probs[j]
        q_token = 1.0 if draft.probs is None else float(draft.probs[j, token])
        # Keep with probability min(1, p/q): u in [0, 1), kept when u * q < p.
        if _uniform(generator, probs.device) * q_token < float(p[token]):
            continue
        if draft.probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft.probs[j].to(p.dtype)).clamp_min_(0.0)
        # A rejection needs p < q at the token, so the residual has mass; float rounding
        # aside, in which case p itself is the exact fallback.
        return j, _draw(residual if float(residual.sum()) > 0 else p, generator)
    return len(draft.token_ids), _draw(probs[-1], generator)


def _logprobs(scaled: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=scaled.device).unsqueeze(1)).squeeze(1)
    width = min(num_top, logprobs.shape[1])
    top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if width:
        values, ids = logprobs.topk(width, dim=-1)
        top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(token_ids, chosen.tolist(), top, strict=True)]


@dataclass
class StepTokens:
    """What a speculative step gives each sequence that samples, in batch order: the tokens to
    append (kept drafts and the target's token after them; a single token for a sequence that
    did not speculate) and, when it asked, their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]

    @classmethod
    def concat(cls, parts: Iterable[StepTokens | SamplerOutput]) -> StepTokens:
        """One step's tokens from those of its parts, in order; a SamplerOutput's rows are one
        token each."""
        token_ids: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        for part in parts:
            if isinstance(part, StepTokens):
                token_ids += part.token_ids
                logprobs += part.logprobs
            else:
                token_ids += [[t] for t in part.token_ids]
                row_logprobs: list[Any] = part.logprobs or [None] * len(part.token_ids)
                # The sampler's interim bridge puts TokenLogprobs (or None) in its logprobs.
                logprobs += [[lp if isinstance(lp, TokenLogprob) else None] for lp in row_logprobs]
        return cls(token_ids, logprobs)
