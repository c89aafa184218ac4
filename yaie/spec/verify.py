"""Verification: which of a sequence's draft tokens the target model keeps, and the token after.

The target scored the sequence's last token followed by its k draft tokens in one forward, so
it has logits rows [k+1, V]: row j is its prediction for the position of draft j (row k, for
the position after the last draft). Each row goes through the sampler's own stages 1-3
(`Sampler.distributions`: logit_bias, min_tokens bans, penalties, temperature, top-k / top-p /
min-p) as a `Position`: the sequence with the history that position would have (the output
so far plus the drafts before it). Every drafting sequence's rows go through in one batch.

Greedy requests keep the longest run of drafts that equal the target's argmax, then take the
target's argmax after it: token for token what decoding without drafts gives. Sampled requests
use rejection sampling: draft j, drawn from the proposer's distribution q, is kept with
probability min(1, p/q), where p is the target's; at the first rejection the token is drawn
from max(p - q, 0), normalised, and if every draft is kept one more is drawn from the last
row. Each emitted token is then distributed exactly as the target's own draw would be, whatever
q is. A proposer that drafts deterministically (an n-gram lookup) has q = a point mass. The
uniform numbers and the draws are the sampler's (draw.py), from the sequence's generator when
it is seeded.

Logprobs are the target's, as the sampler reports them (stage 5): the log_softmax of the
processed logits over the temperature, before truncation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yaie.outputs import TokenLogprob
from yaie.sampling.batch import SamplingSeq
from yaie.sampling.draw import draw_full_rows, uniforms
from yaie.sampling.processors import MaskFiller
from yaie.sampling.sampler import Sampler
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
    logprobs: list[TokenLogprob | None] | None  # one per token, when the request asked
    num_accepted: int  # how many of the draft's tokens were kept


@dataclass
class Position:
    """A row for the sampler (a `SamplingSeq`): a sequence at one of the positions its drafts
    reach, with the output history it would have there."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    output_token_ids: list[int]
    grammar: MaskFiller | None = None  # always None: constrained sequences do not draft (decoder.py)


def positions(seq: SamplingSeq, drafted: list[int]) -> list[Position]:
    """The 1 + len(drafted) rows the target scored for `seq`: after its last token, then after
    each draft."""
    output = list(seq.output_token_ids)
    return [
        Position(seq.sampling_params, seq.prompt_token_ids, seq.generator, output + drafted[:j])
        for j in range(len(drafted) + 1)
    ]


def verify(
    sampler: Sampler, logits: torch.Tensor, seqs: Sequence[SamplingSeq], drafts: Sequence[Draft]
) -> list[Verified]:
    """Check each sequence's draft against the target's logits: ``logits`` holds seqs[i]'s
    1 + k_i rows after those of seqs[:i]."""
    rows = [row for seq, draft in zip(seqs, drafts, strict=True) for row in positions(seq, draft.token_ids)]
    dist = sampler.distributions(logits, sampler.prepare(rows, logits.device))
    results: list[Verified] = []
    # Per row, the token it emitted and, if its request asked, how many alternatives to report.
    emitted: list[int] = [0] * len(rows)
    num_top: list[int | None] = [None] * len(rows)
    first = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        count = 1 + len(draft.token_ids)
        token_ids, accepted = decide(
            dist.probs[first : first + count], draft, seq.sampling_params.greedy, seq.generator
        )
        results.append(Verified(token_ids, None, accepted))
        emitted[first : first + len(token_ids)] = token_ids
        num_top[first : first + len(token_ids)] = [seq.sampling_params.logprobs] * len(token_ids)
        first += count
    if any(k is not None for k in num_top):
        logprobs = dist.token_logprobs(emitted, num_top)
        first = 0
        for seq, draft, result in zip(seqs, drafts, results, strict=True):
            if seq.sampling_params.logprobs is not None:
                result.logprobs = logprobs[first : first + len(result.token_ids)]
            first += 1 + len(draft.token_ids)
    return results


def decide(
    probs: torch.Tensor, draft: Draft, greedy: bool, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """(the tokens to emit, how many drafts they keep), given the target's distributions [k+1, V]
    at the draft's positions as `Sampler.distributions` makes them (a point mass on the argmax
    for a greedy request)."""
    drafted = draft.token_ids
    if greedy:
        best = probs.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafted) and best[accepted] == drafted[accepted]:
            accepted += 1
        return [*drafted[:accepted], best[accepted]], accepted
    for j, token in enumerate(drafted):
        p = probs[j]
        q_token = 1.0 if draft.probs is None else float(draft.probs[j, token])
        # Keep with probability min(1, p/q): u is uniform in (0, 1], kept when u * q < p.
        if float(uniforms(1, [generator], probs.device)[0]) * q_token < float(p[token]):
            continue
        if draft.probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft.probs[j].to(p.dtype)).clamp_min_(0.0)
        # A rejection needs p < q at the token, so the residual has mass; float rounding
        # aside, in which case p itself is the exact fallback.
        row = residual if float(residual.sum()) > 0 else p
        return [*drafted[:j], _draw(row, generator)], j
    return [*drafted, _draw(probs[-1], generator)], len(drafted)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the probabilities [V] (not necessarily normalised), by the sampler's draw."""
    return int(draw_full_rows(probs.unsqueeze(0), [generator])[0])
