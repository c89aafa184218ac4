"""The prompt sets of the load tests, built deterministically so every engine sees the same requests.

- short: ~20 varied short chat questions, cycled;
- long: distinct ~1,000-token prompts (records of made-up measurements + a question), a new one for
  every request of every level, so no prefix cache can reuse an earlier prompt;
- shared-prefix: one ~1,000-token system prompt shared by all requests + 16 different questions,
  the case a prefix cache is for.
"""

from __future__ import annotations

import random

PROMPT_SETS = ("short", "long", "shared-prefix")

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn rain.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a binary search work?",
    "Suggest a name for a friendly robot.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "What are the main ingredients of a pancake?",
    "Describe the water cycle for a ten-year-old.",
    "What is a prime number? Give two examples.",
    "Write a short motivational sentence for a Monday.",
    "How many legs does a spider have, and why?",
    "What is the boiling point of water at sea level?",
    "Explain what an API is in simple terms.",
    "List four planets of the solar system.",
)

SHARED_PREFIX_QUESTIONS = (
    "Which city had the highest reading on day 3?",
    "What is the average of the first five values?",
    "Which instrument appears most often?",
    "Name one record measured in Oslo.",
    "What was the lowest value overall?",
    "How many records mention a humidity sensor?",
    "Which day had the most records?",
    "Summarize the records in two sentences.",
    "Is there any record with a value above 900?",
    "Which cities appear more than once?",
    "What is the unit used in the records?",
    "Describe a trend you notice in the values.",
    "Which record looks like an outlier?",
    "List three different instruments from the log.",
    "What was measured in Lima?",
    "Give the record number of the first entry.",
)

_CITIES = ("Oslo", "Lima", "Cairo", "Perth", "Quito", "Dakar", "Hanoi", "Tromso", "Austin", "Kyoto")
_INSTRUMENTS = ("thermometer", "barometer", "humidity sensor", "anemometer", "rain gauge", "lux meter")
_ADJECTIVES = ("calibrated", "portable", "rooftop", "backup", "coastal", "new", "older", "shaded")
_CHARS_PER_TOKEN = 2.9  # measured on these records with SmolLM2's tokenizer (one token per digit)


def records_text(rng: random.Random, approx_tokens: int) -> str:
    """Made-up measurement records, about approx_tokens long, fully determined by rng."""
    lines = []
    length = 0
    number = rng.randrange(1000, 9000)
    while length < approx_tokens * _CHARS_PER_TOKEN:
        line = (
            f"Record {number}: on day {rng.randrange(1, 31)} the {rng.choice(_ADJECTIVES)} "
            f"{rng.choice(_INSTRUMENTS)} in {rng.choice(_CITIES)} read {rng.randrange(0, 1000)} units."
        )
        lines.append(line)
        length += len(line) + 1
        number += 1
    return "\n".join(lines)


def build_messages(prompt_set: str, index: int, level: int, long_tokens: int) -> list[dict[str, str]]:
    """The chat messages of request `index` of concurrency level number `level`."""
    if prompt_set == "short":
        return [{"role": "user", "content": SHORT_QUESTIONS[index % len(SHORT_QUESTIONS)]}]
    if prompt_set == "long":
        rng = random.Random(f"long-{level}-{index}")
        text = records_text(rng, long_tokens)
        question = SHARED_PREFIX_QUESTIONS[index % len(SHARED_PREFIX_QUESTIONS)]
        return [{"role": "user", "content": f"Here is a log of measurements.\n{text}\n\n{question}"}]
    if prompt_set == "shared-prefix":
        system = "You answer questions about this log of measurements.\n" + records_text(
            random.Random("shared-prefix"), long_tokens
        )
        question = SHARED_PREFIX_QUESTIONS[index % len(SHARED_PREFIX_QUESTIONS)]
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]
    raise ValueError(f"unknown prompt set {prompt_set!r}")
