"""Turn a batch of next-token logits into sampled token ids, one sequence per row.

`Sampler.prepare` gathers the rows' parameters once per step into a `SamplingBatch` ([B]
tensors and lists, index tensors for the sparse ones); `Sampler.sample` then runs the stages
below on the logits, vectorised over the batch: no tensor operation runs per row, except taking
the random number of each seeded row from its own generator. In order:

1. Logits processors (processors.py), on a float32 copy of the logits. ``logit_bias`` is added.
   Then, while a sequence has fewer than ``min_tokens`` output tokens, the tokens that would
   end it (`SamplingParams.ending_token_ids`: its ``stop_token_ids`` and, unless
   ``ignore_eos``, the model's EOS ids) are banned (set to -inf) after the bias, so that no
   bias can lift the ban. Then penalties: ``repetition_penalty`` as in HF/vLLM, for every
   token seen in the prompt or the output, divides a positive logit by the penalty and
   multiplies any other by it; then ``frequency_penalty`` and ``presence_penalty`` as in
   OpenAI, over the output tokens only: ``logit -= frequency_penalty * count +
   presence_penalty * (count > 0)``. The result is the "processed logits". Token ids in these
   parameters are not checked here: the engine refuses out-of-vocabulary ids when a request is
   added, since the sampler cannot reject one row without failing the whole batch.
2. Temperature: greedy rows (temperature 0) take the argmax of the processed logits (lowest id
   on ties) and skip stages 3-4; other rows are divided by their temperature.
3. Truncation (truncation.py): ``top_k`` (-1 or 0: off), then ``top_p`` over the
   top-k-renormalised distribution (the shortest run of most likely tokens whose mass reaches
   top_p), then ``min_p`` (keep tokens with prob >= min_p * max prob). Each cut is a logit
   threshold and a row keeps the logits >= the largest of its thresholds, so tokens tied with
   the last one kept are all kept; this makes the kept set independent of the order in which a
   sort happens to put equal values (bf16 logits tie often). The cut-offs are found with
   ``topk`` over a few candidates rather than a full sort of the vocabulary whenever it can.
4. Draw (draw.py), by inverse CDF: one uniform number u per row, and the token is the first id,
   in id order, at which the running sum of the kept tokens' weights exp(logit - max) reaches
   u * their total. When every sampled row keeps only tokens among the candidates its top_k /
   top_p search ranked, the sums run over those few candidates (put back in id order);
   otherwise over full rows, in chunks. Both give the same token for the same u (up to float
   rounding at a boundary, ~1e-7). A row with a ``generator`` (a seeded sequence) takes its u
   from it, the others from the global RNG; so a row's token depends only on its own logits,
   parameters and u, and a seed gives the same tokens whatever else is in the batch and at
   whatever row. One number per row also replaces the V exponentials per row that an
   exponential race (argmax p / E) needs, which at a batch of a large vocabulary cost more
   than the rest of the sampler (benchmarks/sampler.py).
5. Logprobs (logprobs.py), for rows that asked: log_softmax of the processed logits divided by
   the row's temperature (1 for greedy rows), taken before the truncation of stage 3 so that
   every alternative has a finite value (the distribution actually drawn from is this one
   renormalised over the kept tokens). ``top_logprobs`` are sorted best first, as many per row
   as the row asked for (found once, with the batch's largest ``logprobs``).

When every row is greedy with nothing to apply (no bias, penalties, active min_tokens or
logprobs), the step is a single argmax. Greedy argmaxes of float32 rows on the CPU take the native
kernel (yaie/ops/csrc/argmax.cpp: the same indices, several times faster than torch's at a
batch of a large vocabulary; benchmarks/results/argmax-revisions.txt).

`Sampler.distributions` runs stages 1-3 alone and returns each row's distribution as
probabilities, for callers that decide tokens themselves (speculative decoding's verifier and
draft model, yaie/spec): they see exactly what stage 4 would draw from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from yaie.ops import kernels
from yaie.outputs import TokenLogprob
from yaie.sampling.batch import SamplingBatch, SamplingSeq
from yaie.sampling.draw import draw_from_candidates, draw_full_rows
from yaie.sampling.logprobs import prompt_logprobs, token_logprobs
from yaie.sampling.processors import build_processors
from yaie.sampling.truncation import NEG_INF, Cut, Truncation
from yaie.sampling.weights import exp_weights
from yaie.sampling.workspace import Workspace

__all__ = ["Distributions", "Sampler", "SamplerOutput", "SamplingBatch", "SamplingSeq", "prompt_logprobs"]


@dataclass(frozen=True)
class SamplerOutput:
    """What a step's sampling gives each row's sequence, in batch order: the tokens it appends
    (one drawn token; with speculative decoding, the drafts the target kept and its own token
    after them, yaie/spec/decoder.py) and, where asked, their logprobs."""

    token_ids: list[list[int]]
    # None when no row asked for logprobs; else per row, per token, the token's logprob with
    # the top alternatives (as many as the row asked for, best first), or None for a row that
    # did not ask.
    logprobs: list[list[TokenLogprob | None]] | None = None

    @classmethod
    def concat(cls, parts: Iterable[SamplerOutput]) -> SamplerOutput:
        """One batch's output from those of its parts, in order."""
        parts = list(parts)
        token_ids = [row for part in parts for row in part.token_ids]
        if all(part.logprobs is None for part in parts):
            return cls(token_ids)
        logprobs = [
            row
            for part in parts
            for row in (part.logprobs or [[None] * len(tokens) for tokens in part.token_ids])
        ]
        return cls(token_ids, logprobs)


@dataclass
class Distributions:
    """Stages 1-3 over a batch's rows [n, V], without the draw (see `Sampler.distributions`)."""

    scaled: torch.Tensor  # [n, V] float32: the processed logits over the row's temperature
    log_z: torch.Tensor  # [n]: their logsumexp
    # [n, V] float32: the distribution stage 4 draws from, i.e. the kept tokens' weights
    # normalised; a point mass on the argmax for greedy rows.
    probs: torch.Tensor
    cut: Cut | None  # the truncation; None when every row is greedy

    def token_logprobs(self, token_ids: list[int], num_top: list[int | None]) -> list[TokenLogprob | None]:
        """Stage 5 for these rows: per row, token_ids[row]'s logprob with its ``num_top[row]``
        best alternatives, as the sampler reports them; None for rows whose num_top is None."""
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.scaled.device)
        return token_logprobs(self.scaled, self.log_z, tokens, num_top, self.cut)


class Sampler:
    """``sample(logits [B, V], prepare(seqs, device)) -> SamplerOutput``, row i for seqs[i]
    (one token per row; with drafts to verify, yaie/spec/decoder.py makes the step's output).

    Keeps a few [B, V] work buffers between calls (see Workspace), sized by the largest batch
    seen: about 9 bytes per logit, e.g. 14 MB at batch 32 over 49,152 tokens.
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        # EOS ids are banned, like stop_token_ids, while a sequence is short of min_tokens.
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self._workspace = Workspace()

    def prepare(self, seqs: Sequence[SamplingSeq], device: torch.device) -> SamplingBatch:
        """Gather the rows' parameters for one step, as tensors on ``device`` (the logits')."""
        params = [seq.sampling_params for seq in seqs]
        greedy = [p.greedy for p in params]
        processors = build_processors(seqs, self.eos_token_ids, device)
        logprobs = [p.logprobs for p in params]
        # Greedy rows are scaled by 1: their argmax is unchanged and their logprobs are those
        # of the processed logits.
        temperatures = [p.temperature or 1.0 for p in params]
        return SamplingBatch(
            num_rows=len(seqs),
            plain_greedy=all(greedy) and not processors and all(k is None for k in logprobs),
            processors=processors,
            temperatures=(
                torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1)
                if any(t != 1.0 for t in temperatures)
                else None
            ),
            greedy=greedy,
            greedy_mask=torch.tensor(greedy, device=device),
            # Greedy rows are neither cut nor drawn for (nor do they use their generator).
            truncation=Truncation(
                top_k=[0 if g else p.top_k for p, g in zip(params, greedy, strict=True)],
                top_p=[1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)],
                min_p=[0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)],
            ),
            generators=[None if g else seq.generator for seq, g in zip(seqs, greedy, strict=True)],
            logprobs=logprobs,
        )

    @torch.inference_mode()  # nothing here needs autograd; its buffers stay inference tensors
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V], which are left untouched."""
        if batch.plain_greedy:
            return SamplerOutput([[token] for token in _argmax(logits).tolist()])

        # One working copy, processed in place from here on.
        work = _process(logits, batch, out=self._workspace.get("logits", logits, torch.float32))

        # The rows' log-normaliser, for logprobs and for top_p without top_k, comes with the
        # full-row weights exp(logit - row max), which the draw may need as well.
        weights: torch.Tensor | None = None
        log_z: torch.Tensor | None = None
        logprob_rows = batch.logprob_rows
        if logprob_rows or batch.truncation.needs_log_z(work.shape[1]):
            weights = self._full_row_weights(work)
            log_z = _log_z(work, weights)

        token_ids = _argmax(work) if any(batch.greedy) else None
        cut: Cut | None = None
        if not all(batch.greedy):
            cut = batch.truncation.cut(work, log_z)
            drawn = self._draw(work, weights, cut, batch)
            token_ids = drawn if token_ids is None else torch.where(batch.greedy_mask, token_ids, drawn)
        assert token_ids is not None

        rows = [[token] for token in token_ids.tolist()]
        if not logprob_rows:
            return SamplerOutput(rows)
        assert log_z is not None
        logprobs = token_logprobs(work, log_z, token_ids, batch.logprobs, cut)
        return SamplerOutput(rows, [[entry] for entry in logprobs])

    @torch.inference_mode()
    def distributions(self, logits: torch.Tensor, batch: SamplingBatch) -> Distributions:
        """Stages 1-3 for the rows of ``logits`` [n, V] (left untouched), with the same code as
        `sample`: the probabilities each row's token would be drawn from. The tensors returned
        are the caller's (no work buffer is shared), so they outlive the next call."""
        scaled = _process(logits, batch, out=torch.empty_like(logits, dtype=torch.float32))
        weights = exp_weights(scaled, scaled.amax(dim=-1, keepdim=True))
        log_z = _log_z(scaled, weights)
        cut = None if all(batch.greedy) else batch.truncation.cut(scaled, log_z)
        threshold = _draw_threshold(scaled, cut, batch)
        if threshold is not None:
            _cut_weights(weights, scaled, threshold)
        probs = weights.div_(weights.sum(dim=-1, keepdim=True))
        if any(batch.greedy):
            point = torch.zeros_like(probs).scatter_(1, scaled.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(batch.greedy_mask.unsqueeze(1), point, probs)
        return Distributions(scaled, log_z, probs, cut)

    def _full_row_weights(self, work: torch.Tensor) -> torch.Tensor:
        weights = self._workspace.get("weights", work, work.dtype)
        return exp_weights(work, work.amax(dim=-1, keepdim=True), out=weights)

    def _draw(
        self, work: torch.Tensor, weights: torch.Tensor | None, cut: Cut, batch: SamplingBatch
    ) -> torch.Tensor:
        """Stage 4 for the batch (greedy rows get a token too, which the caller ignores)."""
        threshold = _draw_threshold(work, cut, batch)
        if cut.fits is not None and len(cut.rows) == batch.greedy.count(False) and bool(cut.fits.all()):
            # Every sampled row keeps only some of its top candidates: draw among those. This
            # second path pays (`benchmarks/sampler.py --threads 1`, "all controls" and "top-p
            # only", against every row drawn over full rows): the exponentials, mask and chunk
            # sums of [B, V] cost more than a topk this narrow.
            assert threshold is not None and cut.values is not None and cut.ids is not None
            index = torch.tensor(cut.rows, device=work.device)
            drawn = torch.zeros(batch.num_rows, dtype=torch.long, device=work.device)
            drawn[index] = draw_from_candidates(
                cut.values, cut.ids, threshold[index], [batch.generators[r] for r in cut.rows]
            )
            return drawn
        if weights is None:
            weights = self._full_row_weights(work)
        if threshold is not None:
            _cut_weights(weights, work, threshold, keep=self._workspace.get("keep", work, work.dtype))
        return draw_full_rows(weights, batch.generators)


# Rows whose largest logit is bigger than this in magnitude are shifted to a maximum of 0: the
# later stages take exp(logit - row max) with the exponent floored at row max + EXP_FLOOR, which
# float32 cannot tell from row max itself once the row max's rounding step exceeds that floor.
SHIFT_ABOVE = 2.0**16


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab]."""
    if logits.dtype == torch.float32 and logits.is_contiguous() and kernels.available(logits.device):
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _tame(work: torch.Tensor, logits: torch.Tensor) -> None:
    """Keep every row of the processed logits samplable, in place; ``logits`` are the raw ones.

    +inf reaches here from a model's logits, or from a temperature near the greedy floor that
    overflowed float32; it would turn exp(logit - row max) into NaN, and NaN leaves the
    truncation with no token to keep: +inf becomes the largest float, NaN becomes "never"
    (-inf). A row left with no finite logit at all (every token banned or overflowed) has no
    distribution to draw from; it gets the raw logits' best token rather than failing the batch.
    A row of huge logits is shifted to a maximum of 0 (softmax does not change; a token pushed
    to -inf by the shift had probability 0 in float32 anyway). One reduction finds the rare
    rows that need any of this.
    """
    row_max = work.amax(dim=-1)
    if bool((row_max.abs() <= SHIFT_ABOVE).all()):  # NaN compares False
        return
    tame = {"nan": NEG_INF, "posinf": torch.finfo(work.dtype).max, "neginf": NEG_INF}
    work.nan_to_num_(**tame)
    row_max = work.amax(dim=-1)
    dead = (row_max == NEG_INF).nonzero().squeeze(1)
    if len(dead):
        best = logits[dead].to(work.dtype).nan_to_num(**tame).argmax(dim=-1)
        work[dead] = NEG_INF
        work[dead, best] = 0.0
    huge = ((row_max.abs() > SHIFT_ABOVE) & row_max.isfinite()).nonzero().squeeze(1)
    if len(huge):
        work[huge] -= row_max[huge].unsqueeze(1)


def _process(logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor) -> torch.Tensor:
    """Stages 1-2 into ``out`` (float32, shaped like logits): the processors, then the
    temperatures; then every row made samplable (see _tame)."""
    out.copy_(logits)
    for processor in batch.processors:
        processor.apply(out)
    if batch.temperatures is not None:
        out.div_(batch.temperatures)
    _tame(out, logits)
    return out


def _log_z(scaled: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The rows' logsumexp [n], from their full-row weights exp(logit - row max)."""
    return scaled.amax(dim=-1) + weights.sum(dim=-1).log()


def _draw_threshold(work: torch.Tensor, cut: Cut | None, batch: SamplingBatch) -> torch.Tensor | None:
    """Per row, the smallest logit the draw keeps: the truncation's cut, raised above -inf
    when some processor banned tokens (floored weights are never quite 0, so banned logits
    must be cut explicitly); None when nothing is cut."""
    threshold = None if cut is None else cut.threshold
    if batch.may_ban:
        lowest = torch.finfo(work.dtype).min
        threshold = (
            work.new_full((batch.num_rows,), lowest) if threshold is None else threshold.clamp_min(lowest)
        )
    return threshold


def _cut_weights(
    weights: torch.Tensor, work: torch.Tensor, threshold: torch.Tensor, keep: torch.Tensor | None = None
) -> None:
    """Zero, in place, the weights of the logits below their row's threshold [n]."""
    # The comparison written out as floats (1 kept, 0 cut) and a multiply: both vectorise on a
    # CPU, where a bool mask and masked_fill_ go element by element, about ten times slower
    # over [8, 49152] (the weights are finite, so 0 times any of them is 0).
    weights.mul_(torch.ge(work, threshold.unsqueeze(1), out=keep))
