"""The reasoning split (yaie/server/reasoning.py): whole texts, and the same texts streamed in
every way a tokenizer could cut them, tags split across deltas included."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from yaie.server.reasoning import (
    ReasoningParser,
    ReasoningSplitter,
    Split,
    opens_reasoning,
    split_text,
)

# (output, starts in reasoning, reasoning, content)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("<think>\nLet me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),  # R1 writes the tag itself
    ("  <think>a</think>b", False, "a", "b"),  # whitespace before the opening tag
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),  # the prompt opened <think>
    ("Paris.", False, "", "Paris."),  # no tags, not thinking: untouched
    ("\n\nParis. </think> x", False, "", "\n\nParis. </think> x"),  # an end tag in content is text
    ("Hmm, the capital is", True, "Hmm, the capital is", ""),  # cut short: reasoning alone
    ("<think>\nHmm, the capital", False, "Hmm, the capital", ""),  # opened, never closed
    ("<think>\n\n</think>\n\nParis.", False, "", "Paris."),  # empty reasoning
    ("</think>Paris.", True, "", "Paris."),  # empty reasoning, the prompt opened it
    ("<think></think>", False, "", ""),
    ("", False, "", ""),
    ("", True, "", ""),
    ("Paris. <think>no</think>", False, "", "Paris. <think>no</think>"),  # <think> mid-text is text
    ("a</think>b</think>c", True, "a", "b</think>c"),  # only the first end tag ends reasoning
    ("<thinking>x", False, "", "<thinking>x"),  # not the tag
    ("<thi", False, "", "<thi"),  # a start tag's beginning that never finished
    ("<thi", True, "<thi", ""),
    ("a </thi", True, "a </thi", ""),  # an end tag's beginning that never finished
    ("a\n\n", True, "a", ""),  # trailing whitespace of unfinished reasoning
    ("a</think>\n\n", True, "a", ""),  # an answer of whitespace alone
    ("a</think> b ", True, "a", "b "),  # only the answer's leading whitespace goes
    ("<think>a < b </ c</think>d", False, "a < b </ c", "d"),  # '<' that starts no tag
    ("x<<</think>y", True, "x<<", "y"),
    ("</</think>y", True, "</", "y"),
]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_a_whole_text_is_split(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    assert split_text(text, in_reasoning) == Split(reasoning, content)


def _streamed(pieces: list[str], in_reasoning: bool) -> tuple[Split, list[Split]]:
    splitter = ReasoningSplitter(in_reasoning)
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    total = Split()
    for delta in deltas:
        total += delta
    return total, deltas


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_every_two_cut_stream_adds_up_to_the_whole_split(
    text: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            total, _ = _streamed(pieces, in_reasoning)
            assert total == Split(reasoning, content), pieces


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_one_character_at_a_time(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    total, _ = _streamed(list(text), in_reasoning)
    assert total == Split(reasoning, content)


def test_reasoning_streams_as_it_comes_and_only_a_possible_tag_is_held_back() -> None:
    splitter = ReasoningSplitter(in_reasoning=False)
    assert splitter.feed("<th") == Split()  # maybe <think>
    assert splitter.feed("ink>\n") == Split()  # the tag, then whitespace trimmed
    assert splitter.feed("Let me") == Split("Let me", "")
    assert splitter.feed(" think</") == Split(" think", "")  # "</" may start </think>
    assert splitter.feed("th") == Split()
    assert splitter.feed("ink>\n\n") == Split()  # the end tag, whitespace after it held
    assert splitter.feed("Paris") == Split("", "Paris")
    assert splitter.feed(".") == Split("", ".")
    assert splitter.finish() == Split()


def test_content_without_a_parser_worth_of_tags_is_never_held() -> None:
    splitter = ReasoningSplitter(in_reasoning=False)
    assert splitter.feed("Hello") == Split("", "Hello")
    assert splitter.feed(" <think>") == Split("", " <think>")  # after the start, tags are text


def test_a_held_back_less_than_sign_is_released_when_no_tag_follows() -> None:
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.feed("1 <") == Split("1", "")  # " <" may begin " </think>"
    assert splitter.feed(" 2") == Split(" < 2", "")


TOKENS = st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "\n", " ", "a", "b", "</", "<th"])


@given(
    st.lists(TOKENS, max_size=12),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=80), max_size=5),
)
def test_any_text_cut_anywhere_splits_as_the_whole(
    tokens: list[str], in_reasoning: bool, cuts: list[int]
) -> None:
    text = "".join(tokens)
    bounds = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    total, _ = _streamed(pieces, in_reasoning)
    whole = split_text(text, in_reasoning)
    assert total == whole
    # Nothing but tags and whitespace is dropped: every other character is in one of the parts.
    kept = "".join((whole.reasoning + whole.content).split())
    assert len(kept) >= len("".join(text.split())) - len("<think></think>")


@pytest.mark.parametrize(
    ("tail", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # Qwen3 thinking models' generation prompt
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking: false
        ("<|im_start|>assistant\n", False),
        ("<｜Assistant｜><think>\n", True),  # the R1 distills' template
        ("", False),
    ],
)
def test_whether_the_prompt_opened_reasoning(tail: str, opened: bool) -> None:
    assert opens_reasoning(tail) is opened
    assert ReasoningParser("qwen3").starts_in_reasoning(tail, constrained=False) is opened
    assert ReasoningParser("deepseek_r1").starts_in_reasoning(tail, constrained=False)
    for name in ("qwen3", "deepseek_r1"):  # a grammar holds from the first token: no thinking first
        assert not ReasoningParser(name).starts_in_reasoning(tail, constrained=True)


def test_an_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("granite")
