"""Proposers: where draft tokens come from. One class per `speculative_config` method.

A proposer gets the sequences about to decode and, for each, the most tokens it may draft, and
returns a `Draft` per sequence (possibly empty). Adding a method is adding a class here with
its `method` name and registering it in PROPOSERS.

Settings a method cannot use are refused before anything heavy is allocated: `check_config`
sees the dict alone, `check_target` also the target model the engine is about to load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from yaie.cache.block_pool import BlockPool
from yaie.engine.model_runner import ModelRunner
from yaie.engine.scheduler import ScheduledSequence, SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.model.loader import load_model
from yaie.model.loader_gguf import GGUFCheckpoint
from yaie.sampling.draw import draw_full_rows
from yaie.sampling.sampler import Sampler
from yaie.sampling_params import SamplingParams
from yaie.spec.config import SpeculativeConfig
from yaie.spec.verify import Draft, Position


@dataclass(frozen=True)
class TargetModel:
    """The target model as the engine is about to load it: known before anything is loaded."""

    path: Path  # resolved: the bundled model's when none was named
    quantization: str  # EngineConfig.quantization: how the target's linear layers hold their weights
    device: torch.device


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer may need to know about the engine it drafts for."""

    vocab_size: int
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    model: TargetModel
    quantized: bool  # whether the loaded target's linear layers run quantized


class Proposer(ABC):
    method: ClassVar[str]

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Refuse settings this method cannot use (raise ValueError); nothing is loaded yet.
        Most methods have nothing to check beyond SpeculativeConfig's own checks."""
        return None

    @classmethod
    def check_target(cls, config: SpeculativeConfig, model: TargetModel) -> None:
        """Refuse a target this method cannot draft for (raise ValueError); nothing is loaded yet."""
        return None

    @classmethod
    @abstractmethod
    def create(cls, config: SpeculativeConfig, target: TargetInfo) -> Proposer: ...

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        """A draft of at most max_tokens[i] tokens to follow seqs[i]'s tokens, for every i."""

    def release_finished(self) -> None:
        """Drop whatever is kept for sequences that have finished (a stateless proposer keeps
        nothing)."""
        return None


class NgramProposer(Proposer):
    """Prompt lookup: find the sequence's last n tokens earlier in its own prompt and output
    (n from prompt_lookup_max down to prompt_lookup_min, the latest earlier occurrence first)
    and propose what followed them there. No model; pays off when the output quotes its input."""

    method = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                "speculative_config: ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {lo} and {hi}"
            )

    @classmethod
    def create(cls, config: SpeculativeConfig, target: TargetInfo) -> NgramProposer:
        return cls(config)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq.all_token_ids, k)) for seq, k in zip(seqs, max_tokens, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Every window of n tokens but the last (the suffix itself) is a candidate match.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []


# The most output tokens the draft computes to catch up with a sequence before drafting for it.
# A sequence that decoded without drafts for longer (in a batch above disable_by_batch_size)
# drafts no more: catching up is a prefill of all those tokens through the draft, which the
# drafts left to its answer rarely repay. It is well above what a sequence paused for low
# acceptance falls behind (PAUSE_STEPS tokens), so a pause does not end its drafting.
MAX_CATCH_UP_TOKENS = 32


class DraftModelProposer(Proposer):
    """A smaller model with the same vocabulary drafts k tokens, one forward per token, batched
    over the sequences. It keeps its own paged KV cache in its own block pool: per target
    sequence a shadow `Sequence` holds the tokens whose K/V the draft has computed, and before
    each proposal only the tokens that the target kept differ from (and those after them) are
    computed again."""

    method = "draft_model"

    def __init__(self, runner: ModelRunner, pool: BlockPool, target: TargetInfo) -> None:
        self.runner = runner
        self.pool = pool
        self.block_size = target.block_size
        # The draft samples as the target would, with the same EOS ids banned under min_tokens.
        self.sampler = Sampler(target.eos_token_ids)
        # The draft's view of each target sequence, until the sequence finishes.
        self._shadows: dict[Sequence, Sequence] = {}

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if not config.model:
            raise ValueError("speculative_config: draft_model needs 'model', the draft's path")

    @classmethod
    def create(cls, config: SpeculativeConfig, target: TargetInfo) -> DraftModelProposer:
        assert config.model is not None  # check_config saw to it
        return cls.load(config.model, config.quantization or "none", target)

    @classmethod
    def load(cls, model: str, quantization: str, target: TargetInfo) -> DraftModelProposer:
        """A proposer drafting with the model at `model`, its weights held as `quantization` says."""
        loaded = load_model(
            model, target.dtype, target.device, max_positions=target.max_model_len, quantization=quantization
        )
        check_same_vocabulary(target, loaded.config.vocab_size, loaded.tokenizer, model)
        # As many tokens of draft KV as the target has: every sequence the target holds fits.
        runner = ModelRunner(loaded.model, target.num_kv_blocks, target.block_size, target.dtype)
        return cls(runner, BlockPool(target.num_kv_blocks), target)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True)) if k > 0]
        active = [i for i in active if self._sync(seqs[i], max_tokens[i])]
        # Round 0 computes what the draft has not seen yet (at least the last token); each later
        # round, the token drafted in the round before.
        while active:
            shadows = [self._shadows[seqs[i]] for i in active]
            batch = SchedulerOutput(
                tuple(ScheduledSequence(s, s.num_tokens - s.num_computed_tokens) for s in shadows)
            )
            logits = self.runner.execute(batch).logits
            drafted = [drafts[i].token_ids for i in active]
            tokens, q = self._pick([seqs[i] for i in active], drafted, logits)
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                shadow = self._shadows[seqs[i]]
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.append_token(token)
                drafts[i].token_ids.append(token)
                probs[i].append(q[row : row + 1])
            active = [i for i in active if len(drafts[i].token_ids) < max_tokens[i]]
        for draft, rows in zip(drafts, probs, strict=True):
            if rows:
                draft.probs = torch.cat(rows)
        return drafts

    def _pick(
        self, seqs: list[Sequence], drafted: list[list[int]], logits: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """The draft's next token for each of `seqs` (logits row i for seqs[i], whose drafts so
        far are drafted[i]), through the request's own sampling controls, and the distributions
        [n, V] they were drawn from: the argmax (a point mass) for greedy requests."""
        rows = [
            Position(seq.sampling_params, seq.prompt_token_ids, seq.generator, seq.output_token_ids + done)
            for seq, done in zip(seqs, drafted, strict=True)
        ]
        batch = self.sampler.prepare(rows, logits.device)
        probs = self.sampler.distributions(logits, batch).probs
        tokens = probs.argmax(dim=-1)
        sampled = [row for row, greedy in enumerate(batch.greedy) if not greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            tokens[index] = draw_full_rows(probs[index], [batch.generators[row] for row in sampled])
        return tokens.tolist(), probs

    def _sync(self, seq: Sequence, k: int) -> bool:
        """Bring seq's shadow up to date: keep the K/V of the tokens the target agrees with, and
        hold blocks for the tokens to compute. False, drafting nothing, if the draft's pool has no
        room or the shadow is more than MAX_CATCH_UP_TOKENS of output behind."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            # Default params: the runner must not compute prompt logprobs for the draft.
            shadow = self._shadows[seq] = Sequence(seq.seq_id, seq.prompt_token_ids, SamplingParams())
        known = shadow.all_token_ids[: shadow.num_computed_tokens]
        same = 0
        for mine, theirs in zip(known, seq.all_token_ids, strict=False):
            if mine != theirs:
                break
            same += 1
        if seq.num_tokens - max(same, seq.num_prompt_tokens) > MAX_CATCH_UP_TOKENS:
            return False  # it decoded too long without drafts: catching up would cost more than it saves
        shadow.all_token_ids = list(seq.all_token_ids)
        shadow.num_computed_tokens = min(same, seq.num_tokens - 1)
        self._trim(shadow, shadow.num_computed_tokens)
        # The last token and the first k - 1 drafts go through the draft model.
        needed = -(-(seq.num_tokens + k - 1) // self.block_size) - len(shadow.block_table)
        if needed > self.pool.num_free:
            self._trim(shadow, 0)
            shadow.num_computed_tokens = 0
            return False
        if needed > 0:
            shadow.block_table.extend(self.pool.allocate(needed))
        return True

    def _trim(self, shadow: Sequence, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        self.pool.free(shadow.block_table[keep:])
        del shadow.block_table[keep:]

    def release_finished(self) -> None:
        for seq, shadow in list(self._shadows.items()):
            if seq.status.finished:
                self._trim(shadow, 0)
                del self._shadows[seq]


class SelfProposer(DraftModelProposer):
    """The target's own model file, loaded a second time with quantized weights, drafts for the
    target run unquantized (fp32 or bf16): the output is the exact unquantized model's, and a
    step costs about what the quantized twin's would wherever the twin agrees with it. The draft
    is a draft_model in everything else: its own runner, and a KV pool as large as the
    target's, kept in step with the target's tokens."""

    method = "self"

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if config.model is not None:
            raise ValueError(
                "speculative_config: self drafts with the target's own model file; 'model' names the "
                "draft of draft_model"
            )
        if config.quantization == "none":
            raise ValueError(
                "speculative_config: self drafts with quantized weights ('auto', 'int8' or 'int4'); "
                "with 'none' the draft would be the target itself, at the target's cost"
            )

    @classmethod
    def check_target(cls, config: SpeculativeConfig, model: TargetModel) -> None:
        self_draft_quantization(config, model)

    @classmethod
    def create(cls, config: SpeculativeConfig, target: TargetInfo) -> DraftModelProposer:
        return cls.load(str(target.model.path), self_draft_quantization(config, target.model), target)


def self_draft_quantization(config: SpeculativeConfig, model: TargetModel) -> str:
    """How `self` holds its draft's weights: config.quantization, by default the block types a
    GGUF file stores ("auto"), or int4 made at load where the file stores none. Raises
    ValueError where the draft would cost what the target costs (the target already runs
    quantized, or the draft would run dense) or cannot be made."""
    if model.device.type != "cpu":
        raise ValueError(
            f"speculative_config: self drafts with the quantized kernels, which run on the CPU only "
            f"(device: {model.device})"
        )
    stored = stored_quantized_types(model.path)
    if model.quantization in ("int8", "int4") or (model.quantization == "auto" and stored):
        runs = ", ".join(stored) if model.quantization == "auto" else model.quantization
        raise ValueError(
            f"speculative_config: self drafts with the model's quantized weights for the model run "
            f"unquantized, but the target already runs quantized ({runs}): the draft would be the "
            "target itself, with no gain; run the target with quantization 'none'"
        )
    scheme = config.quantization or ("auto" if stored else "int4")
    if scheme == "auto" and not stored:
        raise ValueError(
            f"speculative_config: {model.path.name} stores no quantized weights, so a draft with "
            "quantization 'auto' would run the target's own dense weights, with no gain; use 'int4' or 'int8'"
        )
    if scheme in ("int8", "int4") and stored:
        raise ValueError(
            f"speculative_config: {model.path.name} already stores quantized weights "
            f"({', '.join(stored)}); quantizing them again to {scheme} would add a second rounding "
            "error: let the draft run them as stored (quantization 'auto', the default)"
        )
    return scheme


def stored_quantized_types(path: Path) -> list[str]:
    """The block types a GGUF file stores its weights in (none for a HF checkpoint): reads the
    file's header and tensor index only."""
    if not path.is_file():
        return []
    return sorted(t.name for t in GGUFCheckpoint(str(path)).quantized_types)


def check_same_vocabulary(target: TargetInfo, vocab_size: int, tokenizer: Any, name: str | None) -> None:
    """A draft must speak the target's tokens: the same ids for the same pieces."""
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {name} has a vocabulary of {vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft must use the target's tokenizer"
        )
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"the draft model {name} has another tokenizer than the target: a draft must use the target's"
        )


PROPOSERS: dict[str, type[Proposer]] = {
    cls.method: cls for cls in (NgramProposer, DraftModelProposer, SelfProposer)
}
