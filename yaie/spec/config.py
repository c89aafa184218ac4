"""The speculative-decoding settings: vLLM's `speculative_config` dict, parsed and checked.

Everything a user can get wrong is refused here, before any model is loaded, so a bad
configuration never leaves an engine half started. (The one check that needs the models, a
draft with another vocabulary, is made when the draft is loaded, before any KV cache exists.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from yaie.config import QUANTIZATIONS

# Drafts longer than this cost more to verify than they can save: each extra position is paid
# for in every verifying forward, and acceptance decays geometrically along a draft.
MAX_SPECULATIVE_TOKENS = 16
# Above this many decoding sequences in a step the forward is no longer bound by reading the
# weights, so verifying drafts stops being nearly free. Where that happens depends on how the
# target holds its weights (benchmarks/speculative.py, docs/speculative-decoding.md "When it
# pays"): a dense target still gains at 4 sequences and no longer at 8; a quantized one gains
# only alone, as its one-row decode kernel costs far less per row than the many-row path a
# verifying step takes.
DISABLE_BY_BATCH_SIZE_DENSE = 4
DISABLE_BY_BATCH_SIZE_QUANTIZED = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # ngram: shortest suffix of the sequence looked up in it
    prompt_lookup_max: int = 4  # ngram: longest such suffix
    model: str | None = None  # draft_model: a .gguf file or HF directory with the same vocabulary
    # How the draft's linear layers hold their weights (EngineConfig.quantization's choices).
    # draft_model: "none" by default; self: a GGUF's stored types by default, else int4.
    quantization: str | None = None
    # No speculation in a step with more decoding sequences than this; None: the measured
    # default for the target's weights (`batch_size_limit`).
    disable_by_batch_size: int | None = None
    # A sequence whose recent acceptance rate (a moving average) falls below this drafts no more
    # for a while; 0 keeps every sequence speculating.
    min_acceptance_rate: float = 0.1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Parse and check the user's dict; raises ValueError naming what is wrong."""
        from yaie.spec.proposers import PROPOSERS  # the registry names the methods

        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        method = raw.get("method")
        if method not in PROPOSERS:
            raise ValueError(
                f"speculative_config: unknown method {method!r}; methods: {', '.join(sorted(PROPOSERS))}"
            )
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        config = cls(**raw)
        config._check()
        PROPOSERS[method].check_config(config)
        return config

    def _check(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be a positive integer, "
                f"got {self.disable_by_batch_size!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config: quantization must be one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(
                f"speculative_config: min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}"
            )

    def batch_size_limit(self, target_quantized: bool) -> int:
        """The most decoding sequences a step may have and still speculate."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DISABLE_BY_BATCH_SIZE_QUANTIZED if target_quantized else DISABLE_BY_BATCH_SIZE_DENSE
