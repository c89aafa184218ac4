"""Incremental detokenization: text deltas that concatenate to exactly the final text.

Decoding tokens one at a time goes wrong in two ways: a multi-byte character split across
tokens decodes to U+FFFD until its last byte arrives, and tokenizers that fold a leading space
into a token (SentencePiece's "▁") drop it when the token is decoded alone. So we decode a short
window that starts a few tokens back (seeded with the prompt's tail for the first tokens), emit
only what the window adds beyond its already-emitted part, and hold back while the window ends
in an incomplete character.
"""

from __future__ import annotations

from typing import Any

# Tokens of left context for a window: enough to settle any merge of spaces or bytes.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text it completes (maybe empty)."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back, replacement characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self.read_offset = len(self.token_ids)
        # Slide the window: keep a few emitted tokens as left context for the next decode.
        self.prefix_offset = max(self.prefix_offset, self.read_offset - _CONTEXT_TOKENS)
        return full_text[len(prefix_text) :]
