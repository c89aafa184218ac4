"""From sampled tokens to what a user sees: the step's last stage.

For every sequence that sampled a token this step, `OutputProcessor.process` appends the token,
advances the sequence's grammar by it (structured outputs), detokenizes it, and applies the stop
rules in one place: EOS and stop tokens (once `min_tokens` are out), stop strings, a completed
grammar, `max_tokens` and the model's context. A finished sequence gets its
status here; the scheduler releases its blocks when it records the step. Then each touched
request gets a `RequestOutput` with its choices' text, deltas and logprobs.

While a stop string could still be forming at the end of a choice's text, that tail is held
back, so a stream never shows part of a stop string.

A failure while processing one request (a tokenizer error on some odd token, say) fails that
request alone: it is finished with `RequestOutput.error` set, and the others carry on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from typing import Any

import torch

from yaie.engine.detokenizer import IncrementalDetokenizer
from yaie.engine.model_runner import RunnerOutput
from yaie.engine.request import Choice, Request
from yaie.engine.scheduler import SchedulerOutput
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.sampling.sampler import SamplerOutput, prompt_logprobs
from yaie.sampling_params import SamplingParams
from yaie.spec.verify import StepTokens

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # unfinished requests, by id
        self._failed: list[RequestOutput] = []  # outputs of failed requests, for the next process()

    def new_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """A request with its n choices, registered here; the caller queues its sequences."""
        request = Request(request_id, prompt, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        for index in range(params.n):
            seq = Sequence(f"{request_id}-{index}", prompt_token_ids, params, request_id, index)
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            request.choices.append(
                Choice(seq, detokenizer, logprobs=[] if params.logprobs is not None else None)
            )
        self.requests[request_id] = request
        return request

    def pop(self, request_id: str) -> Request | None:
        """Forget an unfinished request (an abort); returns it, or None if it is not known."""
        return self.requests.pop(request_id, None)

    def fail(self, request_id: str, error: str) -> None:
        """Finish a request with an error: its sequences are marked aborted (the scheduler
        releases them when it records the step), and its last output, carrying `error`, goes
        out with the next `process`."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for choice in request.choices:
            choice.seq.status = SequenceStatus.FINISHED_ABORTED
            choice.finish_reason = choice.finish_reason or SequenceStatus.FINISHED_ABORTED.value
        self._failed.append(
            RequestOutput(
                request_id=request_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[],
                finished=True,
                error=error,
            )
        )

    def process(
        self, batch: SchedulerOutput, model_output: RunnerOutput, sampled: SamplerOutput | StepTokens
    ) -> list[RequestOutput]:
        """Append the sampled tokens and make the outputs of every request the step touched,
        then of every request failed since the last call. With speculative decoding a sequence
        may get several tokens (`StepTokens`): they are appended one by one, and a stop met on
        one of them drops those after it."""
        for seq, first_target, logits in model_output.prompt_logits:
            with self._failing_alone(seq.request_id):
                self._record_prompt_logprobs(self.requests[seq.request_id], first_target, logits)
        touched: dict[str, Request] = {}
        for seq, token_ids, logprobs in _rows(batch.sampling_seqs, sampled):
            with self._failing_alone(seq.request_id):
                request = self.requests[seq.request_id]
                choice = request.choices[seq.index]
                for token_id, logprob in zip(token_ids, logprobs, strict=True):
                    self._append_token(request, choice, token_id, logprob)
                    if choice.finish_reason is not None:
                        break
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            with self._failing_alone(request.request_id):
                outputs.append(self._make_output(request))
        outputs, self._failed = outputs + self._failed, []
        return outputs

    @contextlib.contextmanager
    def _failing_alone(self, request_id: str) -> Iterator[None]:
        """Turn an error raised while processing one request into that request's failure."""
        try:
            yield
        except Exception as exc:
            logger.exception("processing the output of request %s failed", request_id)
            self.fail(request_id, f"processing the output failed: {exc!r}")

    def _record_prompt_logprobs(self, request: Request, first_target: int, logits: torch.Tensor) -> None:
        known = request.prompt_logprobs
        if known is None or first_target != len(known):
            return  # a sibling's recomputed last token, or a recomputation after a preemption
        targets = torch.tensor(request.prompt_token_ids[first_target : first_target + len(logits)])
        known.extend(prompt_logprobs(logits, targets.to(logits.device), request.params.prompt_logprobs or 0))

    def _append_token(
        self, request: Request, choice: Choice, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        seq, params = choice.seq, request.params
        seq.append_token(token_id)
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The mask allowed only what the grammar accepts, so this is the library's failure.
            raise RuntimeError(f"the grammar refused token {token_id}: {seq.grammar.error}")
        if choice.logprobs is not None and logprob is not None:
            choice.logprobs.append(logprob)
        may_stop = seq.num_output_tokens >= params.min_tokens
        status: SequenceStatus | None = None
        if may_stop and token_id in params.ending_token_ids(self.eos_token_ids):
            status = SequenceStatus.FINISHED_STOPPED
            # As in vLLM: stop_reason names a stop token, and stays None for EOS.
            seq.stop_reason = None if token_id in self.eos_token_ids else token_id
            if seq.stop_reason is not None and params.include_stop_str_in_output:
                choice.text += choice.detokenizer.add(token_id) + choice.detokenizer.flush()
        else:
            delta = choice.detokenizer.add(token_id)
            if delta:
                choice.text += delta
                if may_stop and params.stop and self._cut_at_stop_string(choice, params, len(delta)):
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and seq.grammar is not None and seq.grammar.is_terminated():
            status = SequenceStatus.FINISHED_STOPPED  # nothing more can follow
            choice.text += choice.detokenizer.flush()
        if status is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
            choice.text += choice.detokenizer.flush()
        if status is not None:
            seq.status = status
            choice.finish_reason = status.value

    @staticmethod
    def _cut_at_stop_string(choice: Choice, params: SamplingParams, delta_len: int) -> bool:
        """Cut the text at the first stop string that the newest delta completed."""
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(choice.text) - delta_len - longest + 1)
        hits = [(choice.text.find(s, search_from), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        end = pos + len(stop) if params.include_stop_str_in_output else pos
        choice.text = choice.text[:end]
        choice.seq.stop_reason = stop
        return True

    def _make_output(self, request: Request) -> RequestOutput:
        holdback = max((len(s) for s in request.params.stop), default=1) - 1
        outputs = []
        for choice in request.choices:
            seq = choice.seq
            visible = (
                len(choice.text)
                if choice.finish_reason
                else max(choice.num_sent_chars, len(choice.text) - holdback)
            )
            token_ids = seq.output_token_ids
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=choice.text[:visible],
                    token_ids=token_ids,
                    finish_reason=choice.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=choice.logprobs,
                    delta_text=choice.text[choice.num_sent_chars : visible],
                    delta_token_ids=token_ids[choice.num_sent_tokens :],
                )
            )
            choice.num_sent_chars, choice.num_sent_tokens = visible, len(token_ids)
        if request.finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=request.choices[0].seq.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
        )


def _rows(
    seqs: list[Sequence], sampled: SamplerOutput | StepTokens
) -> Iterator[tuple[Sequence, list[int], list[TokenLogprob | None]]]:
    """Per sequence that sampled: the tokens it gets this step and their logprobs."""
    if isinstance(sampled, StepTokens):
        yield from zip(seqs, sampled.token_ids, sampled.logprobs, strict=True)
        return
    logprobs = sampled.logprobs if sampled.logprobs is not None else [None] * len(sampled.token_ids)
    for seq, token_id, logprob in zip(seqs, sampled.token_ids, logprobs, strict=True):
        yield seq, [token_id], [logprob]
