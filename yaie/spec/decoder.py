"""Speculative decoding in the engine's step: propose before the forward, verify after it.

    schedule() -> propose(batch) -> runner.execute() -> sample(batch, logits) -> process() -> update()

`propose` asks the proposer for drafts for the batch's decoding sequences and has the
scheduler place them after each sequence's last token (within the token budget and the free
blocks). The runner then returns 1 + k logits rows for such a sequence, and `sample` verifies
its drafts (yaie.spec.verify) while the other rows go through the sampler as usual. When no
sequence drafts, the step is the plain one, untouched.

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

from yaie.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.outputs import TokenLogprob
from yaie.sampling.sampler import Sampler
from yaie.spec.config import SpeculativeConfig
from yaie.spec.proposers import PROPOSERS, Proposer, TargetInfo
from yaie.spec.verify import Draft, StepTokens, Verified, verify

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
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        scheduler: Scheduler,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        max_batch_size: int,
    ) -> None:
        self.config = config
        self.max_batch_size = max_batch_size  # the most decoding sequences a speculating step has
        self.proposer = proposer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._drafts: dict[Sequence, Draft] = {}  # this step's, by sequence
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()

    @classmethod
    def create(
        cls, config: SpeculativeConfig, target: TargetInfo, scheduler: Scheduler
    ) -> SpeculativeDecoder:
        proposer = PROPOSERS[config.method].create(config, target)
        limit = config.batch_size_limit(target.quantized)
        return cls(config, proposer, scheduler, target.max_model_len, target.eos_token_ids, limit)

    def propose(self, batch: SchedulerOutput) -> None:
        """Draft for the batch's decoding sequences and schedule the drafts."""
        self._drafts = {}
        decoding = [item for item in batch.scheduled if item.samples and item.num_new_tokens == 1]
        if not decoding or len(decoding) > self.max_batch_size:
            return
        budget = self.scheduler.max_num_batched_tokens - batch.num_batched_tokens
        chosen: list[ScheduledSequence] = []
        limits: list[int] = []
        for item in decoding:
            limit = min(self._draft_limit(item.seq), budget)
            if limit > 0 and self._wants_to_draft(item.seq):
                chosen.append(item)
                limits.append(limit)
                budget -= limit
        if not chosen:
            return
        drafts = self._draft([item.seq for item in chosen], limits)
        for item, draft in zip(chosen, drafts, strict=True):
            if not draft.token_ids:
                continue
            num = self.scheduler.add_lookahead(batch, item, draft.token_ids)
            if num:
                probs = None if draft.probs is None else draft.probs[:num]
                self._drafts[item.seq] = Draft(draft.token_ids[:num], probs)

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

    @property
    def speculating(self) -> bool:
        """Whether this step verifies drafts (after `propose`)."""
        return bool(self._drafts)

    def sample(
        self, batch: SchedulerOutput, logits: torch.Tensor, sampler: Sampler, device: torch.device
    ) -> StepTokens:
        """The tokens of a step that verifies drafts: the rows of sequences without drafts are
        sampled together as usual, the drafting sequences' 1 + k rows each are verified
        together."""
        seqs = batch.sampling_seqs
        plain_rows: list[int] = []  # the row of each sequence without a draft
        draft_rows: list[int] = []  # the 1 + k rows of each sequence with one
        row = 0
        for item in batch.scheduled:
            if item.samples:
                count = 1 + len(item.spec_token_ids)
                if item.seq in self._drafts:
                    draft_rows.extend(range(row, row + count))
                else:
                    plain_rows.append(row)
                row += count
        plain = [seq for seq in seqs if seq not in self._drafts]
        plain_tokens = StepTokens([], [])
        if plain:
            index = torch.tensor(plain_rows, device=logits.device)
            sampled = sampler.sample(logits.index_select(0, index), sampler.prepare(plain, device))
            plain_tokens = StepTokens.concat([sampled])
        drafting = [seq for seq in seqs if seq in self._drafts]
        verified: Iterator[Verified] = iter(())
        if drafting:  # a part of the batch, when a failed step is redone sequence by sequence, may have none
            index = torch.tensor(draft_rows, device=logits.device)
            drafts = [self._drafts[seq] for seq in drafting]
            verified = iter(verify(sampler, logits.index_select(0, index), drafting, drafts))
        token_ids: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        next_plain = 0
        for seq in seqs:
            if seq not in self._drafts:
                token_ids.append(plain_tokens.token_ids[next_plain])
                logprobs.append(plain_tokens.logprobs[next_plain])
                next_plain += 1
                continue
            result = next(verified)
            token_ids.append(result.token_ids)
            logprobs.append(result.logprobs or [None] * len(result.token_ids))
        return StepTokens(token_ids, logprobs)

    def record(self, batch: SchedulerOutput) -> None:
        """After the tokens are appended and before the scheduler records the step: count what
        each draft kept, and pause sequences whose drafts keep failing."""
        for item in batch.scheduled:
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
