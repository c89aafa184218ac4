"""Tests for the batched sampler: synthetic logits on the CPU, no model.

The statistical tests draw thousands of tokens at once as identical rows of one batch, under a
fixed seed, and compare the counts with the expected distribution by a chi-square test.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from yaie.sampling import sampler as sampler_module
from yaie.sampling.sampler import (
    TOP_P_PROBE,
    Sampler,
    SamplingSeq,
    process_logits,
    prompt_logprobs,
    truncation_thresholds,
)
from yaie.sampling_params import SamplingParams

EOS = 1
P_VALUE_FLOOR = 1e-3  # reject a fit at 0.1%; the seeds are fixed, so a pass is reproducible
NUM_DRAWS = 20_000


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    torch.manual_seed(1234)


def make_seq(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    **params: object,
) -> SamplingSeq:
    return SamplingSeq(SamplingParams(**params), list(prompt or []), list(output or []), generator)  # type: ignore[arg-type]


def draw_counts(logits: torch.Tensor, num: int = NUM_DRAWS, **params: object) -> torch.Tensor:
    """Sample num tokens from one row of logits, as num identical rows of one batch."""
    batch = logits.expand(num, -1).contiguous()
    out = Sampler([EOS])(batch, [make_seq(**params)] * num)  # rows only read their seq
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel())


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs, over the tokens with probs > 0."""
    support = probs > 0
    observed = counts[support].double()
    expected = probs[support].double() / probs.sum().double() * counts.sum().double()
    assert expected.min() >= 5, "too few draws for a chi-square test"
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    # The chi-square survival function is the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    outside = ((probs == 0) & (counts > 0)).nonzero().flatten().tolist()
    assert not outside, f"drew tokens outside the support: {outside}"
    if int((probs > 0).sum()) > 1:  # a single token is all the test needs to see
        assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR


# Distinct logits with probabilities that are neither tiny nor tied, so that every cut-off in the
# tests below falls clearly between two tokens.
LOGITS = torch.tensor([2.0, 0.1, 1.2, -0.5, 2.6, 0.7, -1.0, 1.6, 0.3, -0.2])


def reference_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The truncated, renormalised distribution, worked out one token at a time in float64."""
    x = logits.double() / temperature
    probs = torch.softmax(x, dim=0)
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = set(order[:top_k]) if top_k > 0 else set(order)
    kept_mass = sum(float(probs[i]) for i in keep)
    mass_before, nucleus = 0.0, set()
    for i in order:
        if i in keep and mass_before < top_p:
            nucleus.add(i)
            mass_before += float(probs[i]) / kept_mass
    keep &= nucleus
    keep = {i for i in keep if float(probs[i]) >= min_p * float(probs.max())}
    out = torch.zeros_like(probs)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


# -- statistical --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_the_softmax(temperature: float) -> None:
    counts = draw_counts(LOGITS, temperature=temperature)
    assert_follows(counts, reference_probs(LOGITS, temperature))


def test_temperature_changes_the_distribution() -> None:
    # The test has the power to tell temperatures apart: T=0.5 draws do not fit T=1.
    counts = draw_counts(LOGITS, temperature=0.5)
    assert chi_square_p_value(counts, reference_probs(LOGITS, 1.0)) < 1e-12


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_k": 4},
        {"top_p": 0.5},
        {"top_p": 0.8, "temperature": 0.7},
        {"min_p": 0.3},
        {"min_p": 0.1, "temperature": 1.5},
        {"top_k": 6, "top_p": 0.8},
        {"top_k": 6, "top_p": 0.9, "min_p": 0.15, "temperature": 0.8},
    ],
)
def test_truncation_keeps_exactly_the_right_support_and_odds(params: dict) -> None:
    expected = reference_probs(LOGITS, **params)
    assert 1 <= int((expected > 0).sum()) < LOGITS.numel()
    assert_follows(draw_counts(LOGITS, **params), expected)


@pytest.mark.parametrize("params", [{"top_k": 2}, {"top_p": 0.5}])
def test_ties_with_the_last_kept_token_are_kept(params: dict) -> None:
    # Ids 1-3 tie: top_k=2 and top_p=0.5 both stop inside the tie, and keep all of it.
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, 0.5])
    expected = torch.softmax(logits.double(), dim=0) * (logits >= 2.0)
    assert_follows(draw_counts(logits, num=5000, **params), expected / expected.sum())


def test_top_k_off_values_keep_everything() -> None:
    for top_k in (-1, 0, LOGITS.numel(), 10_000):
        counts = draw_counts(LOGITS, num=4000, top_k=top_k)
        assert_follows(counts, reference_probs(LOGITS))


def test_draw_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The full-row draw's two-level inverse CDF: with chunks of 4 tokens a vocabulary of 10 has
    # two full chunks and a short tail chunk, and every token must keep its odds. (min_p cuts
    # on full rows; top_k would draw among its candidates instead.)
    monkeypatch.setattr(sampler_module, "DRAW_CHUNK", 4)
    assert_follows(draw_counts(LOGITS), reference_probs(LOGITS))
    assert_follows(draw_counts(LOGITS, min_p=0.2), reference_probs(LOGITS, min_p=0.2))


def test_draw_across_chunk_edges_of_a_large_vocab() -> None:
    vocab = 2 * sampler_module.DRAW_CHUNK + 300  # two full chunks and a tail
    likely = [0, 511, 512, 1023, 1024, vocab - 1]
    logits = torch.full((vocab,), -30.0)
    logits[likely] = torch.tensor([0.5, 1.0, 0.0, 0.8, 0.2, 1.1])
    for params in ({"min_p": 1e-6}, {"top_k": len(likely)}):  # full rows, then candidates
        counts = draw_counts(logits, num=5000, **params)
        assert_follows(counts, reference_probs(logits, **params))


def test_full_row_and_candidate_draws_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seeded top_k rows are drawn among their candidates when alone and over their full rows
    # when a row without top_k shares the batch: the same seeds must give the same tokens.
    vocab, num = 3000, 300
    logits = 1.5 * torch.randn(num, vocab, generator=torch.Generator().manual_seed(2))
    paths: list[str] = []

    def spy(name: str) -> None:
        draw = getattr(sampler_module, name)

        def recorded(*args: object) -> torch.Tensor:
            paths.append(name)
            return draw(*args)

        monkeypatch.setattr(sampler_module, name, recorded)

    spy("_draw_full_rows")
    spy("_draw_from_candidates")

    def seeded() -> list[SamplingSeq]:
        return [
            make_seq(generator=torch.Generator().manual_seed(s), seed=s, top_k=40, temperature=0.7)
            for s in range(num)
        ]

    candidates = Sampler()(logits, seeded()).token_ids
    with_plain_row = torch.cat([logits, torch.zeros(1, vocab)])
    full_rows = Sampler()(with_plain_row, [*seeded(), make_seq()]).token_ids[:num]
    assert paths == ["_draw_from_candidates", "_draw_full_rows"]
    assert candidates == full_rows
    assert len(set(candidates)) > 20


# -- truncation thresholds ---------------------------------------------------------------------


def reference_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Ids kept by top_k, then top_p, then min_p, keeping ties with the last one kept."""
    x = [float(v) for v in row.double()]
    vocab = len(x)
    desc = sorted(x, reverse=True)
    cut = desc[top_k - 1] if 0 < top_k < vocab else -math.inf
    kept = [v for v in desc if v >= cut]
    if top_p < 1.0:
        z = math.log(sum(math.exp(v - kept[0]) for v in kept)) + kept[0]
        mass_before = 0.0
        for v in kept:
            if mass_before >= top_p:
                break
            p_cut = v
            mass_before += math.exp(v - z)
        cut = max(cut, p_cut)
    if min_p > 0:
        cut = max(cut, desc[0] + math.log(min_p))
    return {i for i in range(vocab) if x[i] >= cut}


def test_truncation_thresholds_match_the_reference_with_ties_and_full_sort_fallback() -> None:
    vocab = 4 * TOP_P_PROBE  # room for nuclei both smaller and larger than the probe
    gen = torch.Generator().manual_seed(7)
    peaked = 4.0 * torch.randn(vocab, generator=gen)
    flat = 0.1 * torch.randn(vocab, generator=gen)
    # bf16 logits tie often; round to a coarse grid to force ties at the cut-offs.
    tied = (2.0 * torch.randn(vocab, generator=gen)).round()
    cases = [
        (peaked, 10, 1.0, 0.0),
        (peaked, 1, 1.0, 0.0),
        (peaked, vocab - 1, 1.0, 0.0),
        (peaked, 0, 0.9, 0.0),  # nucleus within the probe
        (flat, 0, 0.9, 0.0),  # nucleus far larger than the probe: full sort
        (flat, 0, 0.5, 0.001),
        (peaked, 40, 0.7, 0.0),
        (flat, 700, 0.5, 0.0),  # top_k larger than the probe
        (tied, 10, 1.0, 0.0),
        (tied, 10, 0.8, 0.0),
        (tied, 0, 0.6, 0.0),
        (tied, 0, 1.0, 0.05),
        (peaked, 0, 1.0, 0.2),
        (peaked, 25, 0.95, 0.01),
        (peaked, 0, 1.0, 0.0),  # no cut at all in this row
    ]
    logits = torch.stack([c[0] for c in cases])
    top_k, top_p, min_p = ([c[i] for c in cases] for i in (1, 2, 3))
    threshold = truncation_thresholds(logits, top_k, top_p, min_p)
    assert threshold is not None
    for row, (x, k, p, m) in enumerate(cases):
        kept = set((logits[row] >= threshold[row]).nonzero().flatten().tolist())
        assert kept == reference_kept(x, k, p, m), f"case {row}"
        # A row's cut-off does not depend on the rest of the batch.
        alone = truncation_thresholds(x.unsqueeze(0), [k], [p], [m])
        expected = torch.tensor([-math.inf]) if alone is None else alone
        assert torch.equal(expected, threshold[row : row + 1])
    assert truncation_thresholds(logits, [0] * len(cases), [1.0] * len(cases), [0.0] * len(cases)) is None


# -- logits processing --------------------------------------------------------------------------


def reference_process(row: list[float], seq: SamplingSeq, eos: list[int]) -> list[float]:
    """Steps 1-2 one token at a time, in float32 arithmetic like the sampler's tensors."""
    f32 = np.float32
    out = [f32(v) for v in row]
    params = seq.params
    for token_id, bias in params.logit_bias.items():
        if token_id < len(out):
            out[token_id] = f32(out[token_id] + f32(bias))
    if len(seq.output_token_ids) < params.min_tokens:
        for token_id in params.stop_token_ids + ([] if params.ignore_eos else eos):
            if token_id < len(out):
                out[token_id] = f32(-np.inf)
    penalty = f32(params.repetition_penalty)
    for token_id in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        v = out[token_id]
        out[token_id] = f32(v / penalty) if v > 0 else f32(v * penalty)
    for token_id, count in Counter(seq.output_token_ids).items():
        delta = f32(f32(params.frequency_penalty) * f32(count)) + f32(params.presence_penalty)
        out[token_id] = f32(out[token_id] - delta)
    return [float(v) for v in out]


def test_process_logits_matches_the_reference_formulas() -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    seqs = [
        make_seq([1, 2], [3, 4]),  # nothing to apply
        make_seq([5, 6, 6, 7], [7, 8, 8, 9], repetition_penalty=1.3),
        make_seq([5, 6], [7, 8, 8, 8, 9, 10], frequency_penalty=0.7, presence_penalty=0.4),
        make_seq(
            [11, 12], [12, 13, 13], frequency_penalty=-0.5, presence_penalty=-1.0, repetition_penalty=0.8
        ),
        make_seq(
            [20, 21, 21],
            [21, 22, 22, 30],
            repetition_penalty=1.5,
            frequency_penalty=2.0,
            presence_penalty=0.5,
            logit_bias={22: 3.0, 23: -100.0, 0: 5.0, vocab + 7: 50.0},  # out-of-vocab id: ignored
            min_tokens=8,
            stop_token_ids=[40, vocab + 3],
        ),
        make_seq([], [EOS], min_tokens=3, ignore_eos=True, stop_token_ids=[41]),
        make_seq([], [], temperature=0.0, logit_bias={49: 2.5}),
    ]
    logits = 3.0 * torch.randn(len(seqs), vocab, generator=gen)
    before = logits.clone()
    processed = process_logits(logits, seqs, [EOS, 2])
    assert torch.equal(logits, before), "the input logits must stay untouched"
    expected = torch.tensor([reference_process(logits[i].tolist(), s, [EOS, 2]) for i, s in enumerate(seqs)])
    assert torch.equal(processed, expected)
    # Spot checks of the formulas on the reference itself.
    assert torch.equal(processed[0], logits[0])
    assert processed[4, 23] < logits[4, 23] - 99
    assert processed[4, 40] == -math.inf and processed[4, EOS] == -math.inf and processed[4, 2] == -math.inf
    assert processed[5, 41] == -math.inf and processed[5, EOS] == logits[5, EOS]  # ignore_eos


def test_logit_bias_minus_100_bans_a_token() -> None:
    logits = LOGITS.clone()
    best = int(logits.argmax())
    counts = draw_counts(logits, num=5000, logit_bias={best: -100.0})
    assert counts[best] == 0
    sampler = Sampler()
    greedy = sampler(logits.unsqueeze(0), [make_seq(temperature=0.0, logit_bias={best: -100.0})])
    assert greedy.token_ids[0] != best
    forced = sampler(logits.unsqueeze(0), [make_seq(temperature=1.0, logit_bias={6: 100.0})])
    assert forced.token_ids == [6]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    stop = 5
    logits = torch.zeros(20)
    logits[EOS], logits[stop] = 10.0, 9.0  # both far likelier than anything else
    batch = logits.expand(500, -1).contiguous()
    sampler = Sampler([EOS])

    def tokens(output: list[int], **params: object) -> list[int]:
        seqs = [make_seq([], output, min_tokens=3, stop_token_ids=[stop], **params) for _ in range(500)]
        return sampler(batch, seqs).token_ids

    for temperature in (0.0, 1.0):
        short = tokens([7, 8], temperature=temperature)
        assert EOS not in short and stop not in short
    assert set(tokens([7, 8, 9], temperature=0.0)) == {EOS}
    reached = tokens([7, 8, 9], temperature=1.0)
    assert EOS in reached and stop in reached
    # With ignore_eos, EOS ends nothing and so is not held back; the stop id still is.
    ignoring = tokens([7], temperature=0.0, ignore_eos=True)
    assert set(ignoring) == {EOS}
    assert stop not in tokens([7], temperature=1.0, ignore_eos=True)


# -- seeds --------------------------------------------------------------------------------------


def step_logits(step: int, vocab: int) -> torch.Tensor:
    return 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


def generate_seeded(seed: int, row: int, batch: int, steps: int = 25, vocab: int = 1100) -> list[int]:
    """Tokens drawn for one seeded request over several steps at the given row of a batch whose
    other rows change from step to step (other params, other seeds, greedy, unseeded)."""
    params = {"temperature": 0.9, "top_k": 200, "top_p": 0.95, "min_p": 0.01, "logprobs": 2}
    ours = make_seq(generator=torch.Generator().manual_seed(seed), seed=seed, **params)
    neighbours = [
        make_seq(temperature=0.0),
        make_seq(temperature=1.3),
        make_seq(top_p=0.9),  # flat nucleus: the full-sort fallback
        make_seq(generator=torch.Generator().manual_seed(seed + 1), seed=seed + 1, top_k=3),
        make_seq(min_p=0.2, repetition_penalty=1.2, output=[1, 2, 3]),
    ]
    sampler = Sampler([EOS])
    torch.manual_seed(seed * 31 + row)  # the global RNG differs from run to run
    tokens = []
    for step in range(steps):
        others = [neighbours[(step + i) % len(neighbours)] for i in range(batch - 1)]
        seqs = [*others[:row], ours, *others[row:]]
        logits = 0.05 * torch.randn(batch, vocab)
        logits[row] = step_logits(step, vocab)
        token = sampler(logits, seqs).token_ids[row]
        ours.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_same_seed_same_tokens_whatever_the_batch_and_row() -> None:
    alone = generate_seeded(seed=11, row=0, batch=1)
    assert len(set(alone)) > 5  # a real draw, not a constant
    assert generate_seeded(seed=11, row=2, batch=4) == alone
    assert generate_seeded(seed=11, row=5, batch=6) == alone
    assert generate_seeded(seed=12, row=0, batch=1) != alone


# -- logprobs -----------------------------------------------------------------------------------


LOGPROB_BATCHES = {
    "mixed": [
        make_seq([1, 2], [3, 3], temperature=0.0, logprobs=5, repetition_penalty=1.4, logit_bias={7: 2.0}),
        make_seq([], [4], temperature=0.7, top_k=10, logprobs=3, presence_penalty=0.5),
        make_seq(temperature=1.0),  # asked for none
        make_seq(temperature=1.5, logprobs=0),
    ],
    # Every sampled row has top_k: the alternatives come from the truncation's candidates.
    "top_k": [
        make_seq(temperature=0.0),
        make_seq([], [4], temperature=0.7, top_k=10, logprobs=3, frequency_penalty=0.5),
        make_seq([9], [], temperature=1.2, top_k=5, logprobs=5, repetition_penalty=1.1),
        make_seq(top_k=8),
    ],
    "greedy": [make_seq(temperature=0.0, logprobs=4), make_seq(temperature=0.0, logprobs=2, min_tokens=2)],
}


@pytest.mark.parametrize("batch", LOGPROB_BATCHES)
def test_logprobs_are_those_of_the_processed_scaled_logits(batch: str) -> None:
    seqs = LOGPROB_BATCHES[batch]
    logits = 2.0 * torch.randn(len(seqs), 40, generator=torch.Generator().manual_seed(5))
    out = Sampler([EOS])(logits, seqs)
    processed = process_logits(logits, seqs, [EOS])
    # Greedy rows are reported at temperature 1.
    temperatures = torch.tensor([s.params.temperature or 1.0 for s in seqs]).unsqueeze(1)
    expected = torch.log_softmax(processed / temperatures, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None

    for row, seq in enumerate(seqs):
        k = seq.params.logprobs
        if k is None:
            assert math.isnan(out.logprobs[row]) and out.top_logprobs[row] == []
            continue
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(float(expected[row, token]), abs=1e-6)
        top = out.top_logprobs[row]
        assert len(top) == k
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        ref_values, ref_ids = expected[row].topk(k)
        assert [t for t, _ in top] == ref_ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(ref_values.tolist(), abs=1e-6)
        if seq.params.greedy:
            # The greedy token is the most likely one.
            assert token == int(processed[row].argmax())
            if k:
                assert top[0] == (token, out.logprobs[row])


def test_no_logprobs_and_greedy_fast_path() -> None:
    logits = torch.randn(3, 30)
    out = Sampler([EOS])(logits, [make_seq(temperature=0.0) for _ in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    mixed = Sampler([EOS])(logits, [make_seq(temperature=0.0), make_seq(), make_seq(temperature=0.0)])
    assert mixed.logprobs is None
    assert [mixed.token_ids[0], mixed.token_ids[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


def test_sampler_leaves_the_logits_untouched() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    Sampler([EOS])(logits, [make_seq(top_k=5, repetition_penalty=1.2, output=[1]), make_seq(temperature=0.5)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_prompt_logprobs_are_raw_log_softmax_gathers(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK", 3)  # several chunks
    gen = torch.Generator().manual_seed(9)
    logits = 3.0 * torch.randn(7, 25, generator=gen)
    next_ids = torch.randint(0, 25, (7,), generator=gen)
    result = prompt_logprobs(logits, next_ids, k)
    expected = torch.log_softmax(logits, dim=-1)
    assert [r.token_id for r in result] == next_ids.tolist()
    for pos, entry in enumerate(result):
        assert entry.logprob == pytest.approx(float(expected[pos, next_ids[pos]]), abs=1e-6)
        assert [t for t, _ in entry.top] == (expected[pos].topk(k).indices.tolist() if k else [])
        assert [lp for _, lp in entry.top] == pytest.approx(expected[pos].topk(k).values.tolist(), abs=1e-6)
