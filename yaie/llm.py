"""`LLM`: the synchronous, offline API, shaped like vLLM's so its users already know it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from yaie.config import EngineConfig
from yaie.engine.engine import Engine
from yaie.outputs import RequestOutput
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: a .gguf file or HF directory (None = the bundled SmolLM2-135M-Instruct).
        Other keyword arguments are EngineConfig fields (dtype, quantization, max_num_seqs,
        num_kv_blocks, ...). quantization="auto", the default, runs a GGUF file's weights in the
        types it stores and a dense checkpoint in `dtype`; "none" dequantizes every weight to
        `dtype`, which reproduces transformers' outputs exactly."""
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order.
        `priority`: one per prompt, as vLLM (lower first; needs scheduling_policy="priority").
        `timeout`: seconds from this call after which an unfinished request ends with
        finish_reason "timeout", keeping what it generated."""
        one = _is_one_prompt(prompts)
        batch = [cast(Prompt, prompts)] if one else cast("Sequence[Prompt]", prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(sampling_params)} sampling params")
        priority = [0] * len(batch) if priority is None else priority
        if len(priority) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(priority)} priorities")
        ids: list[str] = []
        try:
            for prompt, params, rank in zip(batch, sampling_params, priority, strict=True):
                ids.append(self.engine.add_request(None, prompt, params, priority=rank, timeout=timeout))
        except BaseException:
            for request_id in ids:  # all or none: leave the engine clean for the next call
                self.engine.abort(request_id)
            raise
        return self._run(ids)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None
    ) -> list[RequestOutput]:
        """One vector per prompt from the final hidden states (`RequestOutput.pooled.data`),
        batched together, in prompt order; `pooling_params` default to the engine's pooling,
        normalised (yaie/pooling_params.py)."""
        batch = [cast(Prompt, prompts)] if _is_one_prompt(prompts) else cast("Sequence[Prompt]", prompts)
        params = pooling_params or PoolingParams()
        return self._run([self.engine.add_request(None, prompt, params) for prompt in batch])

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Like generate, with each conversation formatted by the model's own chat template."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = cast("list[list[dict[str, str]]]", messages)
        prompts: list[Prompt] = [self.encode_chat(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.engine.encode_chat(messages)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)  # the engine may run others' requests too (added through `engine`)
        try:
            while len(done) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        done[output.request_id] = output
        except BaseException:
            for request_id in request_ids:  # leave the engine clean for the next call
                if request_id not in done:
                    self.engine.abort(request_id)
            raise
        return [done[request_id] for request_id in request_ids]


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """A text, or a list of token ids (rather than a list of prompts)."""
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
