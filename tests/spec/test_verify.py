"""Verification on synthetic distributions: greedy prefix match, and rejection sampling whose
output is distributed exactly as the sampler's own draws (chi-square over >= 20k samples)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from yaie.sampling.sampler import Sampler
from yaie.sampling_params import SamplingParams
from yaie.spec.verify import Draft, Position, decide, positions, verify

VOCAB = 12
NUM_SAMPLES = 20_000


def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def _seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Position:
    """A sequence as the sampler and the verifier read it."""
    return Position(params, prompt, None, output)


def test_greedy_keeps_the_matching_prefix_then_the_targets_token() -> None:
    logits = _logits(0, 4)
    best = logits.argmax(dim=-1).tolist()
    seq = _seq(SamplingParams(temperature=0), [1, 2], [])
    wrong = (best[2] + 1) % VOCAB
    # Two sequences verified in one batch: their rows follow each other.
    first, second = verify(
        Sampler(), torch.cat([logits, logits[:3]]), [seq, seq], [Draft(best[:3]), Draft([best[0], wrong])]
    )
    assert first.token_ids == best and first.num_accepted == 3
    assert second.token_ids == [best[0], best[1]] and second.num_accepted == 1
    (out,) = verify(Sampler(), logits, [seq], [Draft([best[0], best[1], wrong])])
    assert out.token_ids == [best[0], best[1], best[2]] and out.num_accepted == 2


def test_greedy_applies_the_requests_processing() -> None:
    logits = _logits(1, 2)
    banned = int(logits[0].argmax())
    seq = _seq(SamplingParams(temperature=0, logit_bias={banned: -100.0}), [1], [])
    (out,) = verify(Sampler(), logits, [seq], [Draft([banned])])
    assert out.num_accepted == 0 and out.token_ids[0] != banned


def _sampler_draws(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """NUM_SAMPLES tokens drawn by the sampler from one logits row."""
    seqs = [_seq(params, prompt, output)] * NUM_SAMPLES
    sampler = Sampler()
    batch = sampler.prepare(seqs, logits.device)
    return np.array(sampler.sample(logits.expand(NUM_SAMPLES, -1), batch).token_ids)


def _assert_same_distribution(a: np.ndarray, b: np.ndarray) -> None:
    """Two-sample chi-square over the tokens seen, rare ones pooled so every cell is >= 5."""
    tokens = np.union1d(a, b)
    table = np.array([[np.sum(x == t) for t in tokens] for x in (a, b)])
    common = table.sum(axis=0) >= 10
    pooled = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    pooled = pooled[:, pooled.sum(axis=0) > 0]
    if pooled.shape[1] < 2:
        assert (a == b).all()
        return
    assert chi2_contingency(pooled).pvalue > 0.01


# (sampling controls, whether the draft is a point mass as an n-gram lookup's, or drawn).
CASES = {
    "plain-draft": (SamplingParams(temperature=1.0), False),
    "top_p-ngram": (SamplingParams(temperature=0.7, top_p=0.8), True),
    "top_k+penalties-draft": (
        SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.5, presence_penalty=0.5),
        False,
    ),
    "min_p+frequency-ngram": (SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.7), True),
}


@pytest.mark.parametrize(("params", "point_mass"), CASES.values(), ids=CASES.keys())
def test_rejection_sampling_matches_the_sampler(params: SamplingParams, point_mass: bool) -> None:
    """The first token, and the second when the first was a kept draft x, are distributed as the
    sampler draws them at those positions (the second with x in its history), whatever the
    draft's distribution."""
    prompt, output = [3, 4, 3], [5]
    logits = _logits(2, 3)
    gen = torch.Generator().manual_seed(7)
    # A draft distribution unlike the target's, so that rejections are common.
    q = torch.softmax(_logits(3, 2) * 0.5, dim=-1)
    # An n-gram guess: the target's second choice at each position, so often kept, often not.
    guess = [int(row.topk(2).indices[1]) for row in logits[:2]]
    # The target's rows depend on the draft only through their histories: process them once
    # per distinct draft (what `verify` does), then decide each trial.
    sampler = Sampler()
    seq = _seq(params, prompt, output)
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    drafts = (
        [guess] * NUM_SAMPLES
        if point_mass
        else torch.multinomial(q, NUM_SAMPLES, replacement=True, generator=gen).T.tolist()
    )
    firsts, seconds = [], []
    for tokens in drafts:
        draft = Draft(tokens, None if point_mass else q)
        key = tuple(tokens)
        if key not in rows:
            batch = sampler.prepare(positions(seq, tokens), logits.device)
            rows[key] = sampler.distributions(logits, batch).probs
        token_ids, accepted = decide(rows[key], draft, False, gen)
        firsts.append(token_ids[0])
        if accepted >= 1:
            seconds.append((tokens[0], token_ids[1]))
    _assert_same_distribution(np.array(firsts), _sampler_draws(logits[0:1], params, prompt, output))
    # The second token after the most often kept first draft x.
    x = Counter(first for first, _ in seconds).most_common(1)[0][0]
    after_x = [second for first, second in seconds if first == x]
    assert len(after_x) > 300
    expected = _sampler_draws(logits[1:2], params, prompt, [*output, x])
    _assert_same_distribution(np.array(after_x), expected)


def test_logprobs_are_the_targets() -> None:
    logits = _logits(4, 3)
    seq = _seq(SamplingParams(temperature=0, logprobs=2), [1], [])
    best = logits.argmax(dim=-1).tolist()
    (out,) = verify(Sampler(), logits, [seq], [Draft(best[:2])])
    assert out.logprobs is not None and len(out.logprobs) == 3
    expected = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(out.logprobs):
        assert entry is not None and entry.token_id == best[row]
        assert entry.logprob == pytest.approx(float(expected[row, best[row]]), abs=1e-5)
        assert [t for t, _ in entry.top] == expected[row].topk(2).indices.tolist()
