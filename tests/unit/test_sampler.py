"""Tests for the batched sampler: synthetic logits on the CPU, no model.

The statistical tests draw thousands of tokens at once as identical rows of one batch, under a
fixed seed, and compare the counts with the expected distribution by a chi-square test.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yaie.outputs import TokenLogprob
from yaie.sampling import draw as draw_module
from yaie.sampling import logprobs as logprobs_module
from yaie.sampling import sampler as sampler_module
from yaie.sampling.sampler import Sampler, SamplerOutput, prompt_logprobs
from yaie.sampling.truncation import TOP_P_PROBE, Truncation
from yaie.sampling_params import GREEDY_TEMPERATURE, SamplingParams

EOS = 1
P_VALUE_FLOOR = 1e-3  # reject a fit at 0.1%; the seeds are fixed, so a pass is reproducible
NUM_DRAWS = 20_000


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    torch.manual_seed(1234)


@dataclass
class Row:
    """One row of a batch, as the engine's sequences present it to the sampler."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def make_seq(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    **params: object,
) -> Row:
    return Row(SamplingParams(**params), list(prompt or []), list(output or []), generator)  # type: ignore[arg-type]


@dataclass
class Drawn:
    """A sampler's output with its one token per row unwrapped."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None


def one_per_row(out: SamplerOutput) -> Drawn:
    assert all(len(tokens) == 1 for tokens in out.token_ids)
    if out.logprobs is None:
        return Drawn([token for (token,) in out.token_ids], None)
    assert [len(row) for row in out.logprobs] == [1] * len(out.token_ids)
    return Drawn([token for (token,) in out.token_ids], [entry for (entry,) in out.logprobs])


def run(sampler: Sampler, logits: torch.Tensor, seqs: Sequence[Row]) -> Drawn:
    """One engine step's worth of sampling: prepare the batch, then sample it (one token a row)."""
    return one_per_row(sampler.sample(logits, sampler.prepare(seqs, logits.device)))


def draw_counts(logits: torch.Tensor, num: int = NUM_DRAWS, **params: object) -> torch.Tensor:
    """Sample num tokens from one row of logits, as num identical rows of one batch."""
    batch = logits.expand(num, -1).contiguous()
    out = run(Sampler([EOS]), batch, [make_seq(**params)] * num)  # rows only read their seq
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
    monkeypatch.setattr(draw_module, "DRAW_CHUNK", 4)
    assert_follows(draw_counts(LOGITS), reference_probs(LOGITS))
    assert_follows(draw_counts(LOGITS, min_p=0.2), reference_probs(LOGITS, min_p=0.2))


def test_draw_across_chunk_edges_of_a_large_vocab() -> None:
    vocab = 2 * draw_module.DRAW_CHUNK + 300  # two full chunks and a tail
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

    spy("draw_full_rows")
    spy("draw_from_candidates")

    def seeded() -> list[Row]:
        return [
            make_seq(generator=torch.Generator().manual_seed(s), seed=s, top_k=40, temperature=0.7)
            for s in range(num)
        ]

    candidates = run(Sampler(), logits, seeded()).token_ids
    with_plain_row = torch.cat([logits, torch.zeros(1, vocab)])
    full_rows = run(Sampler(), with_plain_row, [*seeded(), make_seq()]).token_ids[:num]
    assert paths == ["draw_from_candidates", "draw_full_rows"]
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
    threshold = Truncation(top_k, top_p, min_p).cut(logits).threshold
    assert threshold is not None
    for row, (x, k, p, m) in enumerate(cases):
        kept = set((logits[row] >= threshold[row]).nonzero().flatten().tolist())
        assert kept == reference_kept(x, k, p, m), f"case {row}"
        # A row's cut-off does not depend on the rest of the batch.
        alone = Truncation([k], [p], [m]).cut(x.unsqueeze(0)).threshold
        expected = torch.tensor([-math.inf]) if alone is None else alone
        assert torch.equal(expected, threshold[row : row + 1])
    no_cut = Truncation([0] * len(cases), [1.0] * len(cases), [0.0] * len(cases))
    assert no_cut.cut(logits).threshold is None


# -- logits processing --------------------------------------------------------------------------


def processed_logits(logits: torch.Tensor, seqs: Sequence[Row], eos: list[int]) -> torch.Tensor:
    """Stage 1 as the Sampler runs it: its batch's logits processors, in order, on a float32
    copy of logits [B, V]."""
    sampler = Sampler(eos)
    out = logits.to(torch.float32, copy=True)
    for processor in sampler.prepare(seqs, logits.device).processors:
        processor.apply(out)
    return out


def reference_process(row: list[float], seq: Row, eos: list[int]) -> list[float]:
    """Stage 1 one token at a time, in float32 arithmetic like the sampler's tensors."""
    f32 = np.float32
    out = [f32(v) for v in row]
    params = seq.sampling_params
    for token_id, bias in params.logit_bias.items():
        out[token_id] = f32(out[token_id] + f32(bias))
    if len(seq.output_token_ids) < params.min_tokens:
        for token_id in params.stop_token_ids + ([] if params.ignore_eos else eos):
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
            # (The engine refuses out-of-vocabulary ids before they reach the sampler.)
            logit_bias={22: 3.0, 23: -100.0, 0: 5.0},
            min_tokens=8,
            stop_token_ids=[40],
        ),
        make_seq([], [EOS], min_tokens=3, ignore_eos=True, stop_token_ids=[41]),
        make_seq([], [], temperature=0.0, logit_bias={49: 2.5}),
    ]
    logits = 3.0 * torch.randn(len(seqs), vocab, generator=gen)
    before = logits.clone()
    run(Sampler([EOS, 2]), logits, seqs)
    assert torch.equal(logits, before), "the input logits must stay untouched"
    processed = processed_logits(logits, seqs, [EOS, 2])
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
    greedy = run(sampler, logits.unsqueeze(0), [make_seq(temperature=0.0, logit_bias={best: -100.0})])
    assert greedy.token_ids[0] != best
    forced = run(sampler, logits.unsqueeze(0), [make_seq(temperature=1.0, logit_bias={6: 100.0})])
    assert forced.token_ids == [6]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    stop = 5
    logits = torch.zeros(20)
    logits[EOS], logits[stop] = 10.0, 9.0  # both far likelier than anything else
    batch = logits.expand(500, -1).contiguous()
    sampler = Sampler([EOS])

    def tokens(output: list[int], **params: object) -> list[int]:
        seqs = [make_seq([], output, min_tokens=3, stop_token_ids=[stop], **params) for _ in range(500)]
        return run(sampler, batch, seqs).token_ids

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
        token = run(sampler, logits, seqs).token_ids[row]
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
    out = run(Sampler([EOS]), logits, seqs)
    processed = processed_logits(logits, seqs, [EOS])
    # Greedy rows are reported at temperature 1.
    temperatures = torch.tensor([s.sampling_params.temperature or 1.0 for s in seqs]).unsqueeze(1)
    expected = torch.log_softmax(processed / temperatures, dim=-1)
    assert out.logprobs is not None

    for row, seq in enumerate(seqs):
        k = seq.sampling_params.logprobs
        entry = out.logprobs[row]
        if k is None:
            assert entry is None
            continue
        token = out.token_ids[row]
        assert entry is not None and entry.token_id == token
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        top = entry.top
        assert len(top) == k
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        ref_values, ref_ids = expected[row].topk(k)
        assert [t for t, _ in top] == ref_ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(ref_values.tolist(), abs=1e-6)
        if seq.sampling_params.greedy:
            # The greedy token is the most likely one.
            assert token == int(processed[row].argmax())
            if k:
                assert top[0] == (token, entry.logprob)


DISTRIBUTION_CASES = [
    {"temperature": 0.7, "top_p": 0.8},
    {"min_p": 0.3},
    {"top_k": 6, "top_p": 0.9, "min_p": 0.15, "temperature": 0.8},
    {"temperature": 1.5},
]


def test_distributions_are_what_the_draw_draws_from() -> None:
    """Stages 1-3 without the draw (what speculative decoding verifies against): each sampled
    row's truncated distribution, a point mass for greedy rows, processors applied, and the
    logprobs `sample` reports for the same tokens."""
    best = int(LOGITS.argmax())
    seqs = [
        *(make_seq(logprobs=3, **params) for params in DISTRIBUTION_CASES),
        make_seq(temperature=0.0, logprobs=3, logit_bias={best: -100.0}),
        make_seq([], [7], temperature=1.0, logprobs=3, min_tokens=3),
    ]
    logits = LOGITS.expand(len(seqs), -1).contiguous()
    before = logits.clone()
    sampler = Sampler([EOS])
    batch = sampler.prepare(seqs, logits.device)
    dist = sampler.distributions(logits, batch)
    assert torch.equal(logits, before)
    for row, params in enumerate(DISTRIBUTION_CASES):
        expected = reference_probs(LOGITS, **params)
        assert torch.equal(dist.probs[row] > 0, expected > 0)
        torch.testing.assert_close(dist.probs[row].double(), expected, atol=1e-6, rtol=0)
    greedy = len(DISTRIBUTION_CASES)
    second = int(LOGITS.topk(2).indices[1])
    assert dist.probs[greedy].tolist() == [1.0 if t == second else 0.0 for t in range(LOGITS.numel())]
    banned = LOGITS.clone()
    banned[EOS] = -math.inf
    assert dist.probs[greedy + 1, EOS] == 0
    torch.testing.assert_close(dist.probs[greedy + 1].double(), reference_probs(banned), atol=1e-6, rtol=0)

    sampled = one_per_row(sampler.sample(logits, batch))
    assert dist.token_logprobs(sampled.token_ids, [3] * len(seqs)) == sampled.logprobs


def test_no_logprobs_and_greedy_fast_path() -> None:
    logits = torch.randn(3, 30)
    sampler = Sampler([EOS])
    greedy = [make_seq(temperature=0.0) for _ in range(3)]
    assert sampler.prepare(greedy, logits.device).plain_greedy
    out = run(sampler, logits, greedy)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    mixed = run(sampler, logits, [make_seq(temperature=0.0), make_seq(), make_seq(temperature=0.0)])
    assert mixed.logprobs is None
    assert [mixed.token_ids[0], mixed.token_ids[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


def test_sampler_leaves_the_logits_untouched() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    seqs = [make_seq(top_k=5, repetition_penalty=1.2, output=[1]), make_seq(temperature=0.5)]
    run(Sampler([EOS]), logits, seqs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_prompt_logprobs_are_raw_log_softmax_gathers(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROBS_CHUNK", 3)  # several chunks
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


# -- seeded draws pinned across the sampler's rewrite -------------------------------------------

# Every control, one configuration each, as one seeded row.
PIN_VOCAB = 1500
PIN_STEPS = 8
PIN_CONFIGS: dict[str, dict[str, object]] = {
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 0.9, "top_p": 0.8},
    "top_p_flat": {"temperature": 1.0, "top_p": 0.9},  # nucleus past the probe: the full sort
    "min_p": {"temperature": 1.2, "min_p": 0.05},
    "truncation": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.02},
    "penalties": {
        "temperature": 1.0,
        "top_k": 40,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
    },
    "logit_bias": {"temperature": 1.0, "logit_bias": {3: 6.0, 10: 4.0, 17: -100.0}},
    "min_tokens": {"temperature": 1.0, "min_tokens": 5, "stop_token_ids": [4]},
    "logprobs": {"temperature": 0.8, "top_k": 100, "logprobs": 3},
}
# Rows that share the mixed batch: greedy, unseeded, and greedy with processors and logprobs.
PIN_FILLERS: list[dict[str, object]] = [
    {"temperature": 0.0},
    {"temperature": 1.1},
    {"temperature": 0.0, "repetition_penalty": 1.5, "logit_bias": {5: 3.0}, "logprobs": 2},
]
# Recorded with the sampler before its rewrite into stages (commit 6cf217a).
PINNED_TOKENS = {
    "temperature": [393, 825, 1426, 1264, 1284, 1484, 1445, 612],
    "top_k": [1469, 641, 1118, 411, 1283, 814, 407, 860],
    "top_p": [860, 39, 158, 715, 859, 63, 287, 535],
    "top_p_flat": [539, 573, 104, 492, 519, 1152, 1275, 877],
    "min_p": [745, 270, 871, 29, 475, 1052, 1208, 1268],
    "truncation": [1302, 1358, 178, 172, 6, 187, 1050, 1324],
    "penalties": [860, 317, 625, 622, 1362, 1294, 523, 431],
    "logit_bias": [1305, 1130, 1297, 860, 509, 3, 1368, 954],
    "min_tokens": [629, 13, 80, 274, 1214, 1, 1, 1],
    "logprobs": [1391, 450, 709, 671, 786, 932, 236, 965],
}
PINNED_TOP_IDS = [  # the "logprobs" row's alternatives, step by step
    [602, 49, 1391],
    [1405, 186, 845],
    [709, 1265, 146],
    [671, 8, 593],
    [786, 1294, 706],
    [932, 125, 274],
    [236, 703, 402],
    [270, 28, 1229],
]
PINNED_GREEDY_FILLERS = {
    0: [211, 1413, 1455, 714, 904, 1366, 243, 66],
    2: [352, 552, 224, 67, 502, 377, 761, 259],
}


def pin_logits(index: int, name: str, step: int) -> torch.Tensor:
    """Fixed random logits [PIN_VOCAB] for one row and step."""
    x = (0.3 if name == "top_p_flat" else 2.5) * torch.randn(
        PIN_VOCAB, generator=torch.Generator().manual_seed(100 * index + step)
    )
    if name == "min_tokens":  # EOS and the stop id win as soon as they are allowed
        x[EOS] += 14.0
        x[4] += 13.0
    return x


def pin_row(name: str, seed: int) -> Row:
    params = SamplingParams(seed=seed, **PIN_CONFIGS[name])  # type: ignore[arg-type]
    return Row(params, [7, 8, 9, 10, 10], [], torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", PIN_CONFIGS)
def test_seeded_draws_are_pinned_alone(name: str) -> None:
    """A regression pin, generated from the sampler as it was before its rewrite into stages:
    the refactor must give every seeded configuration the very tokens it gave before."""
    index = list(PIN_CONFIGS).index(name)
    sampler = Sampler([EOS, 2])
    row = pin_row(name, 500 + index)
    tokens, top_ids = [], []
    for step in range(PIN_STEPS):
        out = run(sampler, pin_logits(index, name, step).unsqueeze(0), [row])
        tokens.append(out.token_ids[0])
        if out.logprobs is not None:
            entry = out.logprobs[0]
            assert entry is not None
            top_ids.append([token for token, _ in entry.top])
        row.output_token_ids.append(out.token_ids[0])
    assert tokens == PINNED_TOKENS[name]
    assert top_ids == (PINNED_TOP_IDS if name == "logprobs" else [])


def test_seeded_draws_are_pinned_in_a_mixed_batch() -> None:
    """The same regression pin with every configuration in one batch, interleaved with greedy
    and unseeded rows: each seeded row gets its tokens of `test_seeded_draws_are_pinned_alone`,
    and the greedy rows theirs from before the rewrite."""
    sampler = Sampler([EOS, 2])
    torch.manual_seed(99)
    seeded = {name: pin_row(name, 500 + index) for index, name in enumerate(PIN_CONFIGS)}
    fillers = [Row(SamplingParams(**params), [7, 8]) for params in PIN_FILLERS]  # type: ignore[arg-type]
    for step in range(PIN_STEPS):
        rows, logits = [], []
        for index, (name, row) in enumerate(seeded.items()):
            rows.append(row)
            logits.append(pin_logits(index, name, step))
            if index < len(fillers):
                rows.append(fillers[index])
                logits.append(pin_logits(50 + index, "filler", step))
        out = run(sampler, torch.stack(logits), rows)
        for row, token in zip(rows, out.token_ids, strict=True):
            row.output_token_ids.append(token)
    assert {name: row.output_token_ids for name, row in seeded.items()} == PINNED_TOKENS
    for index, tokens in PINNED_GREEDY_FILLERS.items():
        assert fillers[index].output_token_ids == tokens


# -- extremes -----------------------------------------------------------------------------------
# Whatever a model or a request throws at the sampler - logits of +-inf, near float32's limits,
# all equal, temperatures at the greedy floor or enormous, penalties that overflow - every row
# must get a token the row allows, and logprobs that are numbers. A row that cannot be sampled
# would fail the whole batch (every request in it), which is why this is a property of the
# sampler rather than something each caller checks.

INF = math.inf
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
EXTREMES = [INF, -INF, FLOAT32_MAX, -FLOAT32_MAX, 1e30, -1e30, 0.0]
# Sizes on both sides of the truncation's candidate probe, so both its topk path and its
# full-sort path meet the extremes.
BIASES = [-100.0, -1.0, 1.0, 100.0]
VOCABS = [3, 17, TOP_P_PROBE + 1, 700]


@st.composite
def logit_rows(draw: st.DrawFn, vocab: int) -> torch.Tensor:
    """One row: random at some scale, or all equal, with a few extreme values planted in it,
    and at least one token that is not -inf."""
    kind = draw(st.sampled_from(["random", "equal", "extreme"]))
    seed = draw(st.integers(0, 2**16))
    if kind == "random":
        scale = draw(st.sampled_from([1.0, 1e4, 1e30, FLOAT32_MAX / 4]))
        row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    elif kind == "equal":
        row = torch.full((vocab,), draw(st.sampled_from(EXTREMES)))
    else:
        choices = torch.tensor(EXTREMES)
        row = choices[torch.randint(len(EXTREMES), (vocab,), generator=torch.Generator().manual_seed(seed))]
    planted = st.tuples(st.integers(0, vocab - 1), st.sampled_from(EXTREMES))
    for index, value in draw(st.lists(planted, max_size=4)):
        row[index] = value
    if bool((row == -INF).all()):
        row[draw(st.integers(0, vocab - 1))] = draw(st.sampled_from([0.0, FLOAT32_MAX, INF]))
    return row


@st.composite
def params(draw: st.DrawFn, vocab: int) -> dict[str, object]:
    temperature = draw(
        st.sampled_from([0.0, GREEDY_TEMPERATURE, 1e-4, 0.01, 0.7, 1.0, 3.0, 1e30])
        | st.floats(GREEDY_TEMPERATURE, 100.0)
    )
    return {
        "temperature": temperature,
        "top_k": draw(st.sampled_from([-1, 0, 1, 2, 5, vocab - 1, vocab, 2**31 - 1])),
        "top_p": draw(st.sampled_from([1e-9, 0.1, 0.5, 0.95, 1.0]) | st.floats(1e-9, 1.0)),
        "min_p": draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]) | st.floats(0.0, 1.0)),
        "presence_penalty": draw(st.sampled_from([-2.0, 0.0, 2.0])),
        "frequency_penalty": draw(st.sampled_from([-2.0, 0.0, 2.0])),
        "repetition_penalty": draw(st.sampled_from([1e-30, 0.5, 1.0, 2.0, 1e30])),
        "logit_bias": draw(st.dictionaries(st.integers(0, vocab - 1), st.sampled_from(BIASES), max_size=3)),
        "logprobs": draw(st.sampled_from([None, 0, 3])),
    }


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[dict[str, object]], list[list[int]]]:
    vocab = draw(st.sampled_from(VOCABS))
    num_rows = draw(st.integers(1, 4))
    logits = torch.stack([draw(logit_rows(vocab)) for _ in range(num_rows)])
    rows = [draw(params(vocab)) for _ in range(num_rows)]
    outputs = [draw(st.lists(st.integers(0, vocab - 1), max_size=4)) for _ in range(num_rows)]
    return logits, rows, outputs


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_every_row_gets_an_allowed_token_and_finite_logprobs(
    batch: tuple[torch.Tensor, list[dict[str, object]], list[list[int]]],
) -> None:
    logits, rows, outputs = batch
    seqs = [make_seq([], output, **row) for row, output in zip(rows, outputs, strict=True)]
    before = logits.clone()
    out = run(Sampler(), logits, seqs)
    assert torch.equal(logits, before)  # extremes or not, the caller's logits stay as they were

    for row, (token, seq) in enumerate(zip(out.token_ids, seqs, strict=True)):
        raw = logits[row]
        assert 0 <= token < raw.numel()
        # -inf means "never": no penalty, bias or temperature can bring such a token back.
        assert raw[token] > -INF, f"row {row} drew token {token}, whose logit is -inf"
        params_: SamplingParams = seq.sampling_params
        if params_.logprobs is None:
            continue
        assert out.logprobs is not None
        entry = out.logprobs[row]
        assert entry is not None and entry.token_id == token
        assert not math.isnan(entry.logprob) and entry.logprob <= 0.0
        assert len(entry.top) == min(params_.logprobs, raw.numel())
        assert all(not math.isnan(lp) and lp <= 0.0 for _, lp in entry.top)
