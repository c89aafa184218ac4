"""What a grammar matcher allows, for the grammar tests."""

from __future__ import annotations

import torch

from yaie.structured.backend import GrammarMatcher


def allowed_ids(matcher: GrammarMatcher) -> torch.Tensor:
    """The token ids the matcher's mask allows now, in order."""
    bitmask = torch.zeros(1, -(-matcher.vocab_size // 32), dtype=torch.int32)
    matcher.fill_mask(bitmask, 0)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[: matcher.vocab_size].nonzero().view(-1)
