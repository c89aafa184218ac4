"""Reasoning split, as vLLM's `--reasoning-parser`: a model that thinks in `<think>...</think>`
before it answers (Qwen3, the DeepSeek-R1 distills) has its text split into the reasoning and
the answer (`content`), which each API returns in its own field (`reasoning_content` in chat
completions, `thinking` blocks in Anthropic's Messages, `message.thinking` in Ollama's chat).

Where the reasoning starts, per parser:

- `deepseek_r1`: the model's output starts in reasoning (the R1 templates open `<think>` in the
  prompt, or the model writes it first); everything before `</think>` is reasoning, and an output
  without `</think>` (cut short by max_tokens) is reasoning alone.
- `qwen3`: the output is in reasoning when the prompt opened `<think>` (the chat template wrote
  it as the answer's start, and no `</think>` after it: Qwen3's thinking models); with
  `enable_thinking: false` the template closes an empty `<think></think>` itself, and the output
  is all content.

With either, an output that starts with `<think>` (after whitespace) opens its reasoning
there; the tag itself is in neither part. A `<think>` anywhere else is text like any other.
Whitespace around the reasoning is trimmed (after `<think>`, before and after `</think>`), as
Ollama does, so that the answer does not start with the blank lines models write after the tag.

An output constrained by a grammar (response_format, structured_outputs, a required tool call)
is not taken to start in reasoning: the grammar holds from the first token, so the model answers
without thinking first. A grammar that lets it write `<think>` first is still split there.

`ReasoningSplitter` splits a stream of text deltas as they come: a tag may arrive in pieces
across tokens, so a piece that could be the start of one is held back until the next delta says
whether it is. `feed` returns what each delta adds to each part, `finish` what was held back;
together they add up to the same split as the whole text's.
"""

from __future__ import annotations

from dataclasses import dataclass

START_TAG = "<think>"
END_TAG = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens, decoded, show whether the template opened <think>
# (32: room for "<think>\n\n</think>\n\n" in a tokenizer without the tags as tokens of their own)


@dataclass(frozen=True)
class Split:
    """What a piece of text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplitter:
    """One choice's text, split into reasoning and content as its deltas come."""

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning  # where the output starts unless it opens with <think>
        self._state = "start"  # "start": a <think> may still open the output; then "reasoning", "content"
        self._pending = ""  # text held back: maybe part of a tag, or whitespace that may be trimmed
        self._trim = False  # the part just entered drops its leading whitespace

    def feed(self, text: str) -> Split:
        self._pending += text
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(START_TAG):
                    self._pending = head[len(START_TAG) :]
                    self._enter("reasoning")
                    continue
                if START_TAG.startswith(head):  # nothing yet, or maybe the tag's beginning
                    break
                if self._in_reasoning:
                    self._enter("reasoning")
                else:
                    self._state = "content"  # untouched, as without a parser
                continue
            if self._trim:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._trim = False
            if self._state == "content":
                content += self._pending
                self._pending = ""
                break
            end = self._pending.find(END_TAG)
            if end >= 0:
                reasoning += self._pending[:end].rstrip()
                self._pending = self._pending[end + len(END_TAG) :]
                self._enter("content")
                continue
            kept = _held_back(self._pending)
            reasoning += self._pending[: len(self._pending) - kept]
            self._pending = self._pending[len(self._pending) - kept :]
            break
        return Split(reasoning, content)

    def finish(self) -> Split:
        """What was held back, at the end of the output: no tag came of it."""
        pending, self._pending = self._pending, ""
        if self._state == "start":
            return Split(pending.strip(), "") if self._in_reasoning else Split("", pending)
        if self._state == "reasoning":
            return Split(pending.rstrip(), "")
        return Split("", "" if self._trim else pending)

    def _enter(self, state: str) -> None:
        self._state = state
        self._trim = True


def _held_back(text: str) -> int:
    """How many characters at the end of reasoning `text` to hold back: a beginning of the end
    tag, and the whitespace before it (trimmed if the tag follows)."""
    cut = len(text)
    for size in range(min(len(END_TAG) - 1, len(text)), 0, -1):
        if END_TAG.startswith(text[-size:]):
            cut -= size
            break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return len(text) - cut


def split_text(text: str, in_reasoning: bool) -> Split:
    """A whole output's split: the same as its deltas' through one ReasoningSplitter."""
    splitter = ReasoningSplitter(in_reasoning)
    return splitter.feed(text) + splitter.finish()


@dataclass(frozen=True)
class ReasoningParser:
    """The server's `--reasoning-parser`: where a request's output starts."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning parser must be one of {choices}; got {self.name!r}")

    def starts_in_reasoning(self, prompt_tail: str, constrained: bool) -> bool:
        """Whether the output starts in reasoning, given the prompt's last tokens as text
        (`PROMPT_TAIL_TOKENS` of them) and whether a grammar constrains the output."""
        if constrained:
            return False
        if self.name == "deepseek_r1":
            return True
        return opens_reasoning(prompt_tail)


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt leaves a `<think>` open at its end: the template started the answer's
    reasoning."""
    return prompt_tail.rfind(START_TAG) > prompt_tail.rfind(END_TAG)
