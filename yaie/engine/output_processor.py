"""From sampled tokens to what a user sees: the step's last stage.

For every sequence that sampled a token this step, `OutputProcessor.process` appends the token,
advances the sequence's grammar by it (structured outputs), detokenizes it, and applies the stop
rules in one place: EOS and stop tokens (once `min_tokens` are out), stop strings, a completed
grammar, `max_tokens` and the model's context. `process` returns the sequences
the step finished, and the engine has the scheduler release exactly those. Then each touched
request gets a `RequestOutput` with its choices' text, deltas and logprobs.

A pooling request samples nothing: its part of each step's hidden states is summed (mean
pooling) or taken (last pooling), and the step that reaches its prompt's end makes its vector,
normalised if asked, and finishes it: one output, `RequestOutput.pooled`.

While a stop string could still be forming at the end of a choice's text, that tail is held
back, so a stream never shows part of a stop string. A request whose deadline passed gets its
last output from `time_out` (finish_reason "timeout"), between two steps.

The request table is the engine's; this stage only reads it and updates its requests' choices.
A failure while processing one request (a tokenizer error on some odd token, say) fails that
request alone: its output is the last, with `RequestOutput.error` set, its sequences are among
the finished ones, and the others carry on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from yaie.engine.detokenizer import IncrementalDetokenizer
from yaie.engine.model_runner import RunnerOutput
from yaie.engine.request import Choice, Request
from yaie.engine.scheduler import ScheduledSequence, SchedulerOutput
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.errors import InvalidRequestError, RequestFailedError, YaieError
from yaie.outputs import CompletionOutput, PoolingOutput, RequestOutput, TokenLogprob
from yaie.sampling.sampler import SamplerOutput, prompt_logprobs
from yaie.sampling_params import SamplingParams
from yaie.structured import tool_formats
from yaie.structured.tools import FreeText

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def new_choice(self, seq: Sequence) -> Choice:
        """The choice a generating sequence answers with, ready for this stage: a detokenizer, a
        list for its logprobs when its request asks for them, and, when stop rules must leave its
        tool calls whole, a tracker of where they are."""
        params = seq.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        spans = None
        if params.tool_call_spans is not None and (params.stop or params.stop_token_ids):
            spans = tool_formats.call_spans(params.tool_call_spans)
        return Choice(seq, detokenizer, logprobs=logprobs, call_spans=spans)

    def process(
        self,
        requests: Mapping[str, Request],
        plan: SchedulerOutput,
        model_output: RunnerOutput,
        sampled: SamplerOutput,
    ) -> tuple[list[RequestOutput], dict[Sequence, SequenceStatus]]:
        """Append the sampled tokens (a sequence verifying drafts may get several: a stop met
        on one drops those after it) and make the output of every request of `requests` (the
        engine's table) that the step touched. Returns the outputs and the sequences the step
        finished, with how: those stopped, and every sequence of a request that failed here."""
        finished: dict[Sequence, SequenceStatus] = {}
        failed: dict[str, RequestOutput] = {}

        @contextlib.contextmanager
        def failing_alone(request: Request) -> Iterator[None]:
            """Turn an error raised while processing one request into that request's failure."""
            try:
                yield
            except InvalidRequestError as exc:  # its own input: no failure of ours to trace
                logger.warning("request %s failed on its input: %s", request.request_id, exc)
                failed[request.request_id] = fail(request, exc)
                finished.update(unfinished_seqs(request))
            except Exception as exc:
                logger.exception("processing the output of request %s failed", request.request_id)
                failed[request.request_id] = fail(
                    request, RequestFailedError(f"processing the output failed: {exc!r}")
                )
                finished.update(unfinished_seqs(request))

        for seq, first_target, logits in model_output.prompt_logits:
            request = requests[seq.request_id]
            with failing_alone(request):
                self._record_prompt_logprobs(request, first_target, logits)
        pooled_outputs = []
        for item, part in model_output.pooled:
            request = requests[item.seq.request_id]
            with failing_alone(request):
                output = self._pool(request, item, part)
                if output is not None:
                    finished[item.seq] = SequenceStatus.FINISHED_STOPPED
                    pooled_outputs.append(output)
        touched: dict[str, Request] = {}
        logprobs = sampled.logprobs or [[None] * len(tokens) for tokens in sampled.token_ids]
        for seq, token_ids, token_logprobs in zip(
            plan.sampling_seqs, sampled.token_ids, logprobs, strict=True
        ):
            request = requests[seq.request_id]
            if request.request_id in failed:
                continue
            with failing_alone(request):
                choice = request.choices[seq.index]
                for token_id, logprob in zip(token_ids, token_logprobs, strict=True):
                    status = self._append_token(request, choice, token_id, logprob)
                    if status is not None:
                        finished[seq] = status
                        break
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.request_id in failed:
                continue
            with failing_alone(request):
                outputs.append(self._make_output(request))
        return outputs + pooled_outputs + list(failed.values()), finished

    @staticmethod
    def _pool(request: Request, item: ScheduledSequence, part: torch.Tensor) -> RequestOutput | None:
        """Take a pooling sequence's part of the step's hidden states (ModelRunner's `pooled`);
        the step that reaches the prompt's end returns the request's one, finished, output."""
        seq = item.seq
        params = seq.pooling_params
        assert params is not None, "the runner pools only pooling sequences"
        vector = part
        if params.pooling_type == "mean":
            # A chunk from position 0 starts the sum: the first, or the first after a preemption
            # (mean pooling takes nothing from the prefix cache, so every position is computed).
            previous = request.pooled_sum if item.num_computed_tokens else None
            request.pooled_sum = total = part if previous is None else previous + part
            vector = total / seq.num_prompt_tokens
        if not item.pools:
            return None
        if params.normalize:
            vector = F.normalize(vector, dim=0)
        request.choices[0].finish_reason = SequenceStatus.FINISHED_STOPPED.value
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[],
            finished=True,
            num_cached_tokens=seq.num_cached_tokens,
            pooled=PoolingOutput(vector.tolist()),
        )

    def _record_prompt_logprobs(self, request: Request, first_target: int, logits: torch.Tensor) -> None:
        known = request.prompt_logprobs
        if known is None or first_target != len(known):
            return  # a sibling's recomputed last token, or a recomputation after a preemption
        targets = torch.tensor(request.prompt_token_ids[first_target : first_target + len(logits)])
        num_top = request.sampling_params.prompt_logprobs or 0
        known.extend(prompt_logprobs(logits, targets.to(logits.device), num_top))

    def _append_token(
        self, request: Request, choice: Choice, token_id: int, logprob: TokenLogprob | None
    ) -> SequenceStatus | None:
        """Append one token to the choice; returns how it finished the choice, if it did."""
        seq, params, detokenizer = choice.seq, request.sampling_params, choice.detokenizer
        assert detokenizer is not None, "every choice of a generation request has a detokenizer"
        seq.append_token(token_id)
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The mask allowed only what the grammar accepts, so the library gave up: on a limit
            # of its own it met only now (the client's grammar is too much for it), or a failure.
            raise seq.grammar.failure()
        if choice.logprobs is not None and logprob is not None:
            choice.logprobs.append(logprob)
        may_stop = seq.num_output_tokens >= params.min_tokens
        spans = choice.call_spans
        status: SequenceStatus | None = None
        if (
            may_stop
            and token_id in params.ending_token_ids(self.eos_token_ids)
            and (spans is None or not spans.in_call or token_id in self.eos_token_ids)
        ):
            status = SequenceStatus.FINISHED_STOPPED
            # As in vLLM: stop_reason names a stop token, and stays None for EOS.
            seq.stop_reason = None if token_id in self.eos_token_ids else token_id
            if seq.stop_reason is not None and params.include_stop_str_in_output:
                choice.text += detokenizer.add(token_id) + detokenizer.flush()
        else:
            delta = detokenizer.add(token_id)
            if delta:
                choice.text += delta
                # Stop strings apply to free text only: never inside the output a grammar
                # constrains (all of it), nor inside a tool call.
                if seq.grammar is None and (params.stop or spans is not None):
                    end = len(choice.text)
                    free = [(0, end - len(delta), end)] if spans is None else spans.advance(choice.text)
                    if may_stop and params.stop and self._cut_at_stop_string(choice, params, free):
                        status = SequenceStatus.FINISHED_STOPPED
        if status is None and seq.grammar is not None and seq.grammar.is_terminated():
            status = SequenceStatus.FINISHED_STOPPED  # nothing more can follow
            choice.text += detokenizer.flush()
        if status is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
            choice.text += detokenizer.flush()
        if status is not None:
            choice.finish_reason = status.value
        return status

    @staticmethod
    def _cut_at_stop_string(choice: Choice, params: SamplingParams, free: list[FreeText]) -> bool:
        """Cut the text at the first stop string that ends in the newly decided free text
        `free`: (start of its run of free text, start, end) ranges, in order."""
        longest = max(len(s) for s in params.stop)
        for run, start, end in free:
            search_from = max(run, start - longest + 1)
            hits = [(choice.text.find(s, search_from, end), s) for s in params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                cut = pos + len(stop) if params.include_stop_str_in_output else pos
                choice.text = choice.text[:cut]
                choice.seq.stop_reason = stop
                return True
        return False

    def time_out(self, request: Request) -> RequestOutput:
        """The last output of a request whose deadline passed: each choice still going ends
        with finish_reason "timeout", its text complete (nothing is held back any more). A
        pooling request has no partial result: it fails, saying why."""
        for choice in request.choices:
            if choice.finish_reason is None:
                if choice.detokenizer is not None:
                    choice.text += choice.detokenizer.flush()
                choice.finish_reason = SequenceStatus.FINISHED_TIMEOUT.value
        if not isinstance(request.params, SamplingParams):
            error = RequestFailedError("the request's timeout passed before its prompt was pooled")
            return fail(request, error)
        return self._make_output(request)

    def _make_output(self, request: Request) -> RequestOutput:
        params = request.sampling_params
        holdback = 0
        if params.structured_outputs is None:  # stop strings never cut a constrained output
            holdback = max((len(s) for s in params.stop), default=1) - 1
        outputs = []
        for choice in request.choices:
            seq = choice.seq
            visible = len(choice.text)
            if not choice.finish_reason:
                # Text that a stop string may still cut is held back.
                visible -= holdback
                if choice.call_spans is not None:
                    visible = min(visible, choice.call_spans.cut_floor(holdback))
                visible = max(choice.num_sent_chars, visible)
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
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=request.choices[0].seq.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
        )


def fail(request: Request, error: YaieError) -> RequestOutput:
    """Finish a request with an error: its choices are marked aborted, and its last output,
    carrying `error`, is returned."""
    for choice in request.choices:
        choice.finish_reason = choice.finish_reason or SequenceStatus.FINISHED_ABORTED.value
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[],
        finished=True,
        error=error,
    )


def unfinished_seqs(request: Request) -> dict[Sequence, SequenceStatus]:
    """The request's sequences that the scheduler still holds, each to be released as aborted."""
    return {
        choice.seq: SequenceStatus.FINISHED_ABORTED
        for choice in request.choices
        if not choice.seq.status.finished
    }
