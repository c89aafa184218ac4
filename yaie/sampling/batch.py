"""What the sampler knows about one step's batch: the rows it is given and the per-row
parameters gathered from them once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from yaie.sampling.processors import LogitsProcessor, MaskFiller
from yaie.sampling.truncation import Truncation
from yaie.sampling_params import SamplingParams


class SamplingSeq(Protocol):
    """What the sampler reads from one row of the batch; the engine's sequences provide it."""

    prompt_token_ids: list[int]
    generator: torch.Generator | None  # set for seeded sequences
    # Set for sequences with structured outputs, and read only for those.
    grammar: MaskFiller | None

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class SamplingBatch:
    """One step's rows as the sampler's stages consume them, row i for the i-th sequence given
    to `Sampler.prepare`. Greedy rows carry neutral values in the fields of the stages they skip
    (no temperature, no truncation, no generator), so that every field is indexed by row."""

    num_rows: int
    # Every row greedy with nothing to apply (no processor, no logprobs): the step is one argmax.
    plain_greedy: bool
    # Stage 1, in order (logit_bias, min_tokens bans, penalties); only those some row needs.
    processors: list[LogitsProcessor]
    # [B, 1] float32 divisors (1 for greedy rows), or None when every row's is 1.
    temperatures: torch.Tensor | None
    greedy: list[bool]  # temperature 0: take the argmax of the processed logits
    greedy_mask: torch.Tensor  # [B] bool, the same on the logits' device
    truncation: Truncation  # top_k / top_p / min_p per row
    # Per row, the generator its uniform number comes from: the sequence's own for seeded
    # sampled rows, None (the global RNG) otherwise.
    generators: list[torch.Generator | None]
    # Per row, how many top alternatives to report with the sampled token's logprob; None: no
    # logprobs for that row.
    logprobs: list[int | None]

    @property
    def logprob_rows(self) -> list[int]:
        return [row for row, k in enumerate(self.logprobs) if k is not None]

    @property
    def may_ban(self) -> bool:
        """Whether some processor may have set logits to -inf (see LogitsProcessor.bans)."""
        return any(processor.bans for processor in self.processors)
