"""Stage 1 of the sampler: logits processors, which edit the raw logits of the rows that ask
for it before temperature and truncation (grammar masks, logit_bias, min_tokens bans,
penalties).

Each processor is built once per step from the batch's sequences, holding the (row, token id)
entries it touches as index tensors; applying it is then a few tensor operations on those
entries alone, so its cost grows with the entries, not with the vocabulary. The grammar mask
is the exception: it touches whole rows, but only those of constrained sequences.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from yaie.sampling_params import SamplingParams

if TYPE_CHECKING:
    from yaie.sampling.batch import SamplingSeq

NEG_INF = float("-inf")
BITS = 32  # tokens per word of a grammar bitmask


class MaskFiller(Protocol):
    """A sequence's grammar matcher, as the sampler sees it (yaie/structured/backend.py)."""

    vocab_size: int

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None: ...


class LogitsProcessor(ABC):
    """One edit of the batch's logits, built for one step's rows.

    Contract: `apply` works in place on float32 logits [B, V] whose row i belongs to the i-th
    sequence the processor was built from, reads nothing else, and may set a logit to -inf
    only if `bans` is True (the draw then cuts such tokens explicitly, since its floored
    weights are never quite 0).
    """

    bans: bool = False

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> None: ...


def _rows_and_ids(
    token_lists: Sequence[Collection[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token id) pairs of every token of every row, as two long tensors."""
    lengths = [len(ids) for ids in token_lists]
    # numpy reads a chain of Python ints much faster than torch.tensor does, which matters for
    # penalties over long prompts (benchmarks/sampler.py times the penalty rows).
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    rows = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
    return torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)


def _flat(rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """row * vocab_size + token id: an index into the [B * V] view of the logits."""
    return rows * vocab_size + ids


class LogitBias(LogitsProcessor):
    """Adds each row's `logit_bias` to its logits."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
        self.rows, self.ids, self.values = rows, ids, values  # [N] each

    @classmethod
    def build(cls, seqs: Sequence[SamplingSeq], device: torch.device) -> LogitBias | None:
        biases = [seq.sampling_params.logit_bias for seq in seqs]
        if not any(biases):
            return None
        rows, ids = _rows_and_ids([list(bias) for bias in biases], device)
        values = [value for bias in biases for value in bias.values()]
        return cls(rows, ids, torch.tensor(values, dtype=torch.float32, device=device))

    def apply(self, logits: torch.Tensor) -> None:
        logits.view(-1).index_add_(0, _flat(self.rows, self.ids, logits.shape[1]), self.values)


class MinTokensBan(LogitsProcessor):
    """Bans (sets to -inf) the tokens that would end a row still short of `min_tokens`: the
    ids of `SamplingParams.ending_token_ids`. Applied after the bias, so no bias lifts a ban."""

    bans = True

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows, self.ids = rows, ids  # [N] each

    @staticmethod
    def banned_ids(seq: SamplingSeq, eos_token_ids: Collection[int]) -> set[int]:
        """The token ids this row may not produce yet."""
        params = seq.sampling_params
        if len(seq.output_token_ids) >= params.min_tokens:
            return set()
        return params.ending_token_ids(eos_token_ids)

    @classmethod
    def build(
        cls, seqs: Sequence[SamplingSeq], eos_token_ids: Collection[int], device: torch.device
    ) -> MinTokensBan | None:
        banned = [cls.banned_ids(seq, eos_token_ids) for seq in seqs]
        if not any(banned):
            return None
        return cls(*_rows_and_ids(banned, device))

    def apply(self, logits: torch.Tensor) -> None:
        logits.view(-1).index_fill_(0, _flat(self.rows, self.ids, logits.shape[1]), NEG_INF)


# Row b of this table is what byte b of a grammar bitmask adds to its 8 tokens' logits: 0 for
# an allowed token, -inf for a banned one. Adding it is much faster than a masked_fill by a
# [B, V] bool mask, which torch does element by element on the CPU.
_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(
    torch.tensor([[not (byte >> bit) & 1 for bit in range(8)] for byte in range(256)]), NEG_INF
)


class GrammarMask(LogitsProcessor):
    """Bans, in the rows of sequences with structured outputs, every token their grammar does
    not allow next. Each such row's matcher fills its row of a bitmask (one bit per token, set
    when allowed; all rows in parallel, see yaie/structured/backend.py), which becomes a row of
    0 / -inf to add; the other rows are not touched at all. Applied first, so that no bias or
    penalty works on a token the grammar forbids."""

    bans = True

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor) -> None:
        self.rows = rows  # [R] the constrained rows
        self.bias = bias  # [R, V] float32, 0 where allowed and -inf where banned, for rows[r]

    @classmethod
    def build(cls, seqs: Sequence[SamplingSeq], device: torch.device) -> GrammarMask | None:
        rows = [row for row, seq in enumerate(seqs) if seq.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        matchers = [cast("MaskFiller", seqs[row].grammar) for row in rows]
        assert all(matchers), "the engine gives every constrained sequence a matcher"
        vocab_size = matchers[0].vocab_size
        bitmask = torch.empty(len(rows), -(-vocab_size // BITS), dtype=torch.int32)
        # One row after the other, on this thread: llguidance can fill rows in parallel on its
        # own threads (LLExecutor), but with the model's threads on every core those only
        # contended with them, and 8-client JSON decoding ran measurably slower than filling
        # the rows here (benchmarks/grammar_backends.py --throughput).
        for row, matcher in enumerate(matchers):
            matcher.fill_mask(bitmask, row)
        # Byte k of a row holds tokens 8k..8k+7, lowest bit first (the words are little-endian).
        byte_ids = bitmask.to(device).view(torch.uint8).view(-1).int()
        bias = _BYTE_BIAS.to(device).index_select(0, byte_ids).view(len(rows), -1)[:, :vocab_size]
        return cls(torch.tensor(rows, device=device), bias)

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_add_(0, self.rows, self.bias)


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


class Penalties(LogitsProcessor):
    """``repetition_penalty`` as in HF/vLLM: for every token seen in the prompt or the output, a
    positive logit is divided by the penalty and any other is multiplied by it. Then
    ``frequency_penalty`` and ``presence_penalty`` as in OpenAI, over the output tokens only:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``."""

    def __init__(
        self,
        output: tuple[torch.Tensor, torch.Tensor],
        prompt: tuple[torch.Tensor, torch.Tensor] | None,
        repetition: torch.Tensor | None,
        frequency: torch.Tensor | None,
        presence: torch.Tensor | None,
    ) -> None:
        self.output = output  # (rows, ids) of the penalised rows' output tokens, repeats included
        self.prompt = prompt  # (rows, ids) of the prompts of rows with a repetition penalty
        self.repetition = repetition  # [B] float32, or None when no row has one
        self.frequency = frequency  # [B] float32; None (with presence) when no row has either
        self.presence = presence

    @classmethod
    def build(cls, seqs: Sequence[SamplingSeq], device: torch.device) -> Penalties | None:
        params = [seq.sampling_params for seq in seqs]
        penalised = [has_penalty(p) for p in params]
        if not any(penalised):
            return None
        outputs = [seq.output_token_ids if pen else [] for seq, pen in zip(seqs, penalised, strict=True)]
        repetition = [p.repetition_penalty for p in params]
        prompt = repetition_t = None
        if any(r != 1.0 for r in repetition):
            # Only rows with a repetition penalty need their prompt, which can be long.
            prompts = [
                seq.prompt_token_ids if r != 1.0 else [] for seq, r in zip(seqs, repetition, strict=True)
            ]
            prompt = _rows_and_ids(prompts, device)
            repetition_t = torch.tensor(repetition, dtype=torch.float32, device=device)
        frequency = presence = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device)
        return cls(_rows_and_ids(outputs, device), prompt, repetition_t, frequency, presence)

    def apply(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[1]
        flat = logits.view(-1)
        # One entry per distinct (row, output token), with how often the row produced it.
        seen_output, counts = torch.unique(_flat(*self.output, vocab), return_counts=True)
        if self.repetition is not None:
            assert self.prompt is not None
            # Repeated entries are harmless: each copy reads the same old value and writes the
            # same new one.
            seen = torch.cat([_flat(*self.prompt, vocab), seen_output])
            penalty = self.repetition[seen // vocab]
            old = flat[seen]
            new = torch.where(old > 0, old / penalty, old * penalty)
            # A huge logit times a huge penalty is still a logit, not a ban (-inf) or +inf.
            finfo = torch.finfo(logits.dtype)
            flat[seen] = torch.where(old.isfinite(), new.clamp(finfo.min, finfo.max), new)
        if self.frequency is not None and self.presence is not None:
            row = seen_output // vocab
            flat[seen_output] -= self.frequency[row] * counts.to(logits.dtype) + self.presence[row]


def build_processors(
    seqs: Sequence[SamplingSeq], eos_token_ids: Collection[int], device: torch.device
) -> list[LogitsProcessor]:
    """The processors this batch needs, in the order they apply."""
    candidates = (
        GrammarMask.build(seqs, device),
        LogitBias.build(seqs, device),
        MinTokensBan.build(seqs, eos_token_ids, device),
        Penalties.build(seqs, device),
    )
    return [processor for processor in candidates if processor is not None]
