"""/v1/completions' responses: streamed chunks of text, or the whole completion.

One request may carry several prompts, each with `n` choices; choice `prompt * n + i` answers
prompt `prompt`. With `echo` the prompt's text comes first (and, with logprobs, its tokens'
logprobs); the logprobs columns' text offsets count from the start of the choice's text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.server import protocol as p
from yaie.server.streaming import Generation, new_logprobs

Prompt = str | list[int]


class Completion:
    """The response to one text completion request."""

    def __init__(
        self,
        request_id: str,
        model: str,
        body: p.CompletionRequest,
        prompts: Sequence[Prompt],
        decode_prompt: Callable[[list[int]], Awaitable[str]],
        decode: p.Decode,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.body = body
        self.prompts = prompts
        self.decode_prompt = decode_prompt  # a prompt's token ids to its text, for echo
        self.decode = decode
        self.created = p.now()

    async def _echo(self, prompt: int) -> str:
        text = self.prompts[prompt]
        return text if isinstance(text, str) else await self.decode_prompt(text)

    async def chunks(self, generation: Generation) -> AsyncGenerator[p.CompletionResponse, None]:
        """The stream: each choice's new text (and logprobs) as tokens come, a finish chunk per
        choice (with its stop_reason), and the usage last when the request asks for it."""
        body = self.body
        text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                choice = update.choice
                text, tokens = choice.delta_text, []
                if update.first and body.echo:  # the echo goes first
                    text = await self._echo(update.prompt) + text
                    if body.logprobs is not None:
                        tokens = _prompt_logprobs(update.output)
                tokens += [(lp.token_id, lp) for lp in new_logprobs(choice)]
                if text or tokens:
                    logprobs = None
                    if body.logprobs is not None:
                        offset = text_offsets.get(update.index, 0)
                        logprobs = p.completion_logprobs(tokens, self.decode, offset)
                        text_offsets[update.index] = offset + sum(len(token) for token in logprobs.tokens)
                    yield self._chunk([p.CompletionChoice(index=update.index, text=text, logprobs=logprobs)])
                if (reason := update.finish_reason) is not None:
                    last = p.CompletionChoice(
                        index=update.index, text="", finish_reason=reason, stop_reason=choice.stop_reason
                    )
                    yield self._chunk([last])
        if body.include_usage:
            yield self._chunk([], usage=generation.usage())

    def _chunk(self, choices: list[p.CompletionChoice], usage: p.Usage | None = None) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    async def response(self, finals: Sequence[RequestOutput], usage: p.Usage) -> p.CompletionResponse:
        """The whole completion, from each prompt's finished output."""
        choices = []
        for prompt, final in enumerate(finals):
            echo = await self._echo(prompt) if self.body.echo else ""
            for choice in sorted(final.outputs, key=lambda c: c.index):
                choices.append(self._choice(prompt * self.body.n + choice.index, echo, choice, final))
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _choice(
        self, index: int, echo: str, choice: CompletionOutput, final: RequestOutput
    ) -> p.CompletionChoice:
        text = echo + choice.text
        logprobs = None
        if self.body.logprobs is not None:
            tokens = _prompt_logprobs(final) if self.body.echo else []
            tokens += [(lp.token_id, lp) for lp in choice.logprobs or []]
            if text or tokens:
                logprobs = p.completion_logprobs(tokens, self.decode, 0)
        return p.CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )


def _prompt_logprobs(output: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
    """(token id, logprob) for each prompt token, for echo with logprobs."""
    # to_sampling_params asks for prompt logprobs whenever echo comes with logprobs.
    assert output.prompt_logprobs is not None
    return list(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))
