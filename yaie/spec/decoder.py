"""Speculative decoding in the engine's step: draft while the step is planned, verify after it.

    schedule() [-> propose(decoding sequences, room)] -> runner.execute() -> sample(plan, logits)
    -> process() -> update()

The scheduler, as it plans a step, asks `propose` for drafts for the step's decoding sequences
and places them after each sequence's last token (within the token budget and the free blocks):
the plan it returns holds them. The runner then returns 1 + k logits rows for such a sequence,
and `sample` verifies its drafts (yaie.spec.verify) while the other rows go through the sampler
as usual. When no sequence drafts, the step is the plain one, untouched.

Speculation pays only while a forward is bound by reading the weights: a step with more
decoding sequences than `disable_by_batch_size` (by default measured per kind of target weights,
SpeculativeConfig.batch_size_limit) drafts nothing, and a sequence whose drafts
keep being rejected (a moving average of its acceptance rate below `min_acceptance_rate`)
pauses drafting for PAUSE_STEPS of its steps.

Failures stay with their request, as in the plain step: the forward and `sample` run inside
the engine's `_forward`, which redoes a failed step sequence by sequence (drafts included), and
a proposer that fails on a sequence only pauses that sequence's drafting (see `_draft`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from yaie.engine.scheduler import SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.outputs import TokenLogprob
from yaie.sampling.sampler import Sampler, SamplerOutput
from yaie.spec.config import SpeculativeConfig
from yaie.spec.proposers import PROPOSERS, Proposer, TargetInfo
from yaie.spec.verify import Draft, Verified, verify

logger = logging.getLogger(__name__)

# Weight of the newest step in a sequence's moving average of its acceptance rate.
ACCEPTANCE_SMOOTHING = 0.25
# Steps a sequence with a low acceptance rate decodes without drafts before it tries again.
PAUSE_STEPS = 16


@dataclass
class SpecDecodeStats:
    """Counters, named as vLLM's spec_decode_* metrics."""

    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: kept at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the kept drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _SeqState:
    acceptance: float = 1.0  # moving average of the share of its drafts kept
    paused_steps: int = 0


class SpeculativeDecoder:
    """The scheduler's `Drafter` (drafts go into the step's plan as it is made) and the step's
    sampler for a plan with drafts (`sample`)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        max_batch_size: int,
    ) -> None:
        self.config = config
        self.max_batch_size = max_batch_size  # the most decoding sequences a speculating step has
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        # The last plan's drafts, by sequence, with the distributions they were drawn from; the
        # plan holds as many of each draft's tokens as found room.
        self._drafts: dict[Sequence, Draft] = {}
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()

    @classmethod
    def create(cls, config: SpeculativeConfig, target: TargetInfo) -> SpeculativeDecoder:
        proposer = PROPOSERS[config.method].create(config, target)
        limit = config.batch_size_limit(target.quantized)
        return cls(config, proposer, target.max_model_len, target.eos_token_ids, limit)

    def propose(self, seqs: list[Sequence], room: int) -> list[list[int]]:
        """Drafts for the step's decoding sequences, at most `room` tokens in all (Drafter)."""
        self._drafts = {}
        if len(seqs) > self.max_batch_size:
            return [[] for _ in seqs]
        chosen: list[Sequence] = []
        limits: list[int] = []
        for seq in seqs:
            limit = min(self._draft_limit(seq), room)
            if limit > 0 and self._wants_to_draft(seq):
                chosen.append(seq)
                limits.append(limit)
                room -= limit
        if chosen:
            self._drafts = dict(zip(chosen, self._draft(chosen, limits), strict=True))
        return [self._drafts[seq].token_ids if seq in self._drafts else [] for seq in seqs]

    def _draft(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        """The proposer's drafts. Drafts only save time, so a proposer that fails on some
        sequence costs that sequence its drafts, not its request: the batch is drafted again
        one sequence at a time, and one that still fails alone decodes without drafts for
        PAUSE_STEPS steps."""
        try:
            return self.proposer.propose(seqs, limits)
        except Exception:
            logger.exception("drafting for %d sequences failed; drafting one at a time", len(seqs))
        drafts = []
        for seq, limit in zip(seqs, limits, strict=True):
            try:
                drafts.extend(self.proposer.propose([seq], [limit]))
            except Exception:
                logger.exception("drafting for sequence %s failed alone; it pauses drafting", seq.seq_id)
                self._states.setdefault(seq, _SeqState()).paused_steps = PAUSE_STEPS
                drafts.append(Draft([]))
        return drafts

    def _draft_limit(self, seq: Sequence) -> int:
        """Drafts worth making: the last one's position must fit the context, and with the
        target's own token after them they must not run past max_tokens."""
        limit = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        return limit

    def _wants_to_draft(self, seq: Sequence) -> bool:
        if seq.grammar is not None:
            # Verifying drafts would need the grammar's mask at every drafted position (advance
            # the matcher through the draft, roll it back after): not done yet, so structured
            # outputs decode one token a step.
            return False
        state = self._states.setdefault(seq, _SeqState())
        if state.paused_steps > 0:
            state.paused_steps -= 1
            if state.paused_steps == 0:
                state.acceptance = 1.0
            return False
        return True

    def sample(self, plan: SchedulerOutput, logits: torch.Tensor, sampler: Sampler) -> SamplerOutput:
        """The tokens of a step that verifies drafts: the rows of sequences without drafts are
        sampled together as usual, the drafting sequences' 1 + k rows each are verified
        together."""
        plain: list[Sequence] = []
        plain_rows: list[int] = []  # the row of each sequence without a draft
        drafting: list[Sequence] = []
        drafts: list[Draft] = []
        draft_rows: list[int] = []  # the 1 + k rows of each sequence with one
        row = 0
        for item in plan.scheduled:
            if not item.samples:
                continue
            if item.spec_token_ids:
                # The plan holds as many of the draft's tokens as found room: their first ones.
                count = len(item.spec_token_ids)
                probs = self._drafts[item.seq].probs
                drafting.append(item.seq)
                drafts.append(Draft(list(item.spec_token_ids), None if probs is None else probs[:count]))
                draft_rows.extend(range(row, row + 1 + count))
                row += 1 + count
            else:
                plain.append(item.seq)
                plain_rows.append(row)
                row += 1
        plain_out = (
            iter(())
            if not plain
            else _rows(sampler.sample(_select(logits, plain_rows), sampler.prepare(plain, logits.device)))
        )
        # A part of the plan, when a failed step is redone sequence by sequence, may have no drafts.
        verified: Iterator[Verified] = iter(())
        if drafting:
            verified = iter(verify(sampler, _select(logits, draft_rows), drafting, drafts))
        token_ids: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        for item in plan.scheduled:
            if not item.samples:
                continue
            if item.spec_token_ids:
                result = next(verified)
                token_ids.append(result.token_ids)
                logprobs.append(result.logprobs or [None] * len(result.token_ids))
            else:
                tokens, row_logprobs = next(plain_out)
                token_ids.append(tokens)
                logprobs.append(row_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def record(self, plan: SchedulerOutput) -> None:
        """Once the step's tokens are appended: count what each draft kept, pause sequences
        whose drafts keep failing, and let the proposer forget finished sequences."""
        for item in plan.scheduled:
            if not item.spec_token_ids:
                continue
            kept, drafted = item.num_kept_spec_tokens(), len(item.spec_token_ids)
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += drafted
            stats.num_accepted_tokens += kept
            for position in range(kept):
                stats.num_accepted_tokens_per_pos[position] += 1
            state = self._states.setdefault(item.seq, _SeqState())
            state.acceptance += ACCEPTANCE_SMOOTHING * (kept / drafted - state.acceptance)
            if state.acceptance < self.config.min_acceptance_rate:
                state.paused_steps = PAUSE_STEPS
        self.proposer.release_finished()


def _select(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


def _rows(sampled: SamplerOutput) -> Iterator[tuple[list[int], list[TokenLogprob | None]]]:
    """Per row of a sampler's output: its tokens and their logprobs (None where not asked)."""
    for row, tokens in enumerate(sampled.token_ids):
        yield tokens, sampled.logprobs[row] if sampled.logprobs is not None else [None] * len(tokens)
