"""The engine: requests in, tokens out, one `step()` at a time.

    step() = scheduler.schedule() -> runner.execute() -> sampler() -> postprocess

Postprocessing appends each sampled token, detokenizes it, and decides whether the request is
done (EOS, stop token, stop string, max_tokens, context full). The engine is synchronous and
single-threaded; `LLM` loops over it, the async server drives it from a background thread.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError

from yaie.cache.block_pool import BlockPool
from yaie.config import EngineConfig
from yaie.engine.detokenizer import IncrementalDetokenizer
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.engine.scheduler import ScheduledSequence, Scheduler
from yaie.errors import InvalidRequestError
from yaie.model.loader import load_model
from yaie.engine.model_runner import ModelRunner
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.sampling.sampler import Sampler, SamplingSeq, prompt_logprobs
from yaie.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 2 << 30  # ~45k tokens of SmolLM2-135M in fp32; zeroing it costs ~1 s
DEFAULT_GPU_KV_FRACTION = 0.85


@dataclass
class _Choice:
    """One of a request's n completions: a scheduler Request plus its text state."""

    index: int
    request: Sequence
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    num_emitted_chars: int = 0  # of `text`, already handed out as deltas
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)
    # With n > 1, choices after the first wait here until the first has computed the prompt;
    # they then share its KV blocks rather than computing the same prompt n times.
    pending: list[_Choice] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled as the prompt is computed

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int  # held by sequences
    num_cached_kv_blocks: int  # held only by the prefix cache, which may evict them
    kv_block_bytes: int
    num_preemptions: int
    num_computed_prompt_tokens: int  # prompt tokens actually run through the model (not cache hits)

    @property
    def kv_cache_used_bytes(self) -> int:
        return self.num_used_kv_blocks * self.kv_block_bytes

    @property
    def kv_cache_cached_bytes(self) -> int:
        return self.num_cached_kv_blocks * self.kv_block_bytes

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    if dtype == "auto":
        # These CPUs have no native bf16 maths: float32 is both exact and faster there.
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return dev, names[dtype]


def default_kv_cache_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_KV_FRACTION)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP)


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device, self.dtype = resolve_device_and_dtype(config.device, config.dtype)
        loaded = load_model(config.model, self.dtype, self.device, max_positions=config.max_model_len)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds

        block_bytes = ModelRunner.bytes_per_block(loaded.model, config.block_size, self.dtype)
        num_blocks = (
            config.num_kv_blocks
            or (config.kv_cache_memory or default_kv_cache_memory(self.device)) // block_bytes
        )
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget is smaller than one block ({block_bytes} bytes)")
        self.kv_block_bytes = block_bytes
        self.max_model_len = self._max_model_len(num_blocks)
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, self.dtype)
        self.block_pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            self.block_pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            prefix_cache=self._make_prefix_cache(),
        )  # fmt: skip
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[Sequence, tuple[_Group, _Choice]] = {}
        self._ids = itertools.count()
        self._forking: list[_Group] = []  # groups with choices still waiting for the shared prompt
        self.num_computed_prompt_tokens = 0

    def _max_model_len(self, num_blocks: int) -> int:
        cfg = self.model_config
        limit = self.config.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window:  # we attend to the whole context, which is exact only inside the window
            limit = min(limit, cfg.sliding_window)
        capacity = num_blocks * self.config.block_size
        if capacity < limit:
            logger.warning("KV cache holds %d tokens; limiting max_model_len from %d", capacity, limit)
        return min(limit, capacity)

    def _make_prefix_cache(self) -> Any:
        if not self.config.enable_prefix_caching:
            return None
        try:
            from yaie.cache.radix_cache import RadixCache
        except ImportError:
            return None
        return RadixCache(self.block_pool, self.config.block_size)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for input we refuse."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)

        group = _Group(request_id, text, token_ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # position 0 has nothing before it to predict it (as vLLM)
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Any integer is a valid seed: fold it into the 64 bits a generator takes.
                generator = torch.Generator(self.device).manual_seed((params.seed + index) % 2**64)
            request = Sequence(f"{request_id}-{index}", token_ids, params)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            choice = _Choice(index, request, detok, generator)
            if params.logprobs is not None:
                choice.logprobs = []
            group.choices.append(choice)
            self._choice_of[request] = (group, choice)
            if index == 0:
                self.scheduler.add(request)
            else:
                group.pending.append(choice)
        self._groups[request_id] = group
        if group.pending:
            self._forking.append(group)
        return request_id

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation through the model's own chat template, ready to answer."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use a plain prompt", "messages")
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as exc:  # templates raise on conversations they do not accept
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"{name}: token ids must be below the vocabulary size {vocab}", param=name
                )
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}",
                "prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds this "
                f"model's context of {self.max_model_len} tokens",
                "max_tokens",
            )

    def abort(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        if group in self._forking:
            self._forking.remove(group)
        for choice in group.choices:
            if choice.finish_reason is None:
                self.scheduler.finish(choice.request, SequenceStatus.FINISHED_ABORTED)
            del self._choice_of[choice.request]
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def stats(self) -> EngineStats:
        cache = self.scheduler.prefix_cache
        num_cached = 0 if cache is None else cache.num_tree_only_blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.block_pool.num_blocks,
            num_used_kv_blocks=self.block_pool.num_used - num_cached,
            num_cached_kv_blocks=num_cached,
            kv_block_bytes=self.kv_block_bytes,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_prompt_tokens=self.num_computed_prompt_tokens,
        )

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return []
        sampling = [item for item in batch.scheduled if item.samples]
        self.num_computed_prompt_tokens += sum(
            max(
                0, min(item.seq.num_prompt_tokens - item.seq.num_computed_tokens, item.num_new_tokens)
            )
            for item in batch.scheduled
        )
        result = self.runner.execute(batch)
        self.scheduler.update(batch)
        self._fork_pending_choices()
        touched: dict[str, _Group] = {}
        for request, first_target, logits in result.prompt_logits:
            group, choice = self._choice_of[request]
            if choice.index == 0:
                self._record_prompt_logprobs(group, first_target, logits)
        if not sampling:
            return []
        seqs = [self._sampling_seq(item) for item in sampling]
        sampled = self.sampler(result.logits, seqs)

        for row, item in enumerate(sampling):
            group, choice = self._choice_of[item.seq]
            logprob = None
            if choice.logprobs is not None and sampled.logprobs is not None:
                top = sampled.top_logprobs[row] if sampled.top_logprobs else []  # already cut to this row's k
                logprob = TokenLogprob(sampled.token_ids[row], sampled.logprobs[row], top)
            self._append_token(group, choice, sampled.token_ids[row], logprob)
            touched[group.request_id] = group
        return [self._make_output(group) for group in touched.values()]

    def _record_prompt_logprobs(self, group: _Group, first_target: int, logits: torch.Tensor) -> None:
        known = group.prompt_logprobs
        if known is None or first_target != len(known):
            return  # recomputation after a preemption: these positions are already recorded
        targets = torch.tensor(group.prompt_token_ids[first_target : first_target + len(logits)])
        known.extend(prompt_logprobs(logits, targets.to(logits.device), group.params.prompt_logprobs or 0))

    def _fork_pending_choices(self) -> None:
        for group in list(self._forking):
            source = group.choices[0].request
            if source.num_computed_tokens >= source.num_prompt_tokens or source.status.finished:
                for choice in group.pending:
                    self.scheduler.add(choice.request, share_prefix_of=source)
                group.pending.clear()
                self._forking.remove(group)

    def _sampling_seq(self, item: ScheduledSequence) -> SamplingSeq:
        request = item.seq
        _, choice = self._choice_of[request]
        return SamplingSeq(
            request.sampling_params, request.prompt_token_ids, request.output_token_ids, choice.generator
        )

    def _append_token(
        self, group: _Group, choice: _Choice, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        request, params = choice.request, group.params
        request.append_token(token_id)
        if choice.logprobs is not None and logprob is not None:
            choice.logprobs.append(logprob)
        may_stop = request.num_output_tokens >= params.min_tokens
        status: SequenceStatus | None = None
        if may_stop and (
            (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
        ):
            status = SequenceStatus.FINISHED_STOPPED
            # As in vLLM: stop_reason names a stop token, and stays None for EOS.
            request.stop_reason = None if token_id in self.eos_token_ids else token_id
            if request.stop_reason is not None and params.include_stop_str_in_output:
                choice.text += choice.detokenizer.add(token_id) + choice.detokenizer.flush()
        else:
            delta = choice.detokenizer.add(token_id)
            if delta:
                choice.text += delta
                if may_stop and params.stop and self._find_stop_string(choice, params, len(delta)):
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and (
            (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
            or request.num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if status is SequenceStatus.FINISHED_LENGTH:
                choice.text += choice.detokenizer.flush()
            choice.finish_reason = status.value
            self.scheduler.finish(request, status)

    @staticmethod
    def _find_stop_string(choice: _Choice, params: SamplingParams, delta_len: int) -> bool:
        """Cut the text at the first stop string that the newest delta completed."""
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(choice.text) - delta_len - longest + 1)
        hits = [(choice.text.find(s, search_from), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        choice.text = (
            choice.text[: pos + len(stop)] if params.include_stop_str_in_output else choice.text[:pos]
        )
        choice.request.stop_reason = stop
        return True

    def _make_output(self, group: _Group) -> RequestOutput:
        params = group.params
        # While a stop string could still be forming at the end of the text, hold that tail back
        # so a stream never shows part of a stop string.
        holdback = max((len(s) for s in params.stop), default=1) - 1
        outputs = []
        for choice in group.choices:
            request = choice.request
            visible = (
                len(choice.text)
                if choice.finish_reason
                else max(choice.num_emitted_chars, len(choice.text) - holdback)
            )
            token_ids = request.output_token_ids
            outputs.append(
                CompletionOutput(
                    index=choice.index,
                    text=choice.text[:visible],
                    token_ids=token_ids,
                    finish_reason=choice.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=choice.logprobs,
                    delta_text=choice.text[choice.num_emitted_chars : visible],
                    delta_token_ids=token_ids[choice.num_emitted_tokens :],
                )
            )
            choice.num_emitted_chars, choice.num_emitted_tokens = visible, len(token_ids)
        finished = group.finished
        if finished:
            del self._groups[group.request_id]
            for choice in group.choices:
                del self._choice_of[choice.request]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=group.choices[0].request.num_cached_tokens,
            prompt_logprobs=group.prompt_logprobs,
        )
