"""The engine: requests in, outputs out, one `step()` at a time. It owns every request's life.

    step() = scheduler.schedule() -> runner.execute() -> sampler.sample()
             -> output_processor.process() -> scheduler.update()

The engine holds the request table: `add_request` makes a request's sequences and queues them
with the scheduler; `step` runs the five stages; finished requests leave the table when their
last output is made, and an abort or a failure goes through the engine, which tells the
scheduler what to free. The scheduler plans which sequences compute which tokens (an immutable
`SchedulerOutput`; with speculative decoding it holds the drafts to verify, yaie/spec/decoder.py),
the runner runs the plan through the model, the sampler draws each sampling sequence's tokens,
the output processor appends them, applies the stop rules and makes the outputs, returning the
sequences that finished, and the scheduler records the step and frees exactly those.

The engine is synchronous and single-threaded: only its own thread calls it (`LLM` loops over
it, the server drives it from `AsyncEngine`'s thread). The tokenizer's work on a request
(encoding, chat templates, grammar compiles, checks) is the `InputProcessor`'s, which is
thread-safe, so the server runs it elsewhere and hands the engine a processed request.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.config import EngineConfig
from yaie.engine.input_processor import InputProcessor, ProcessedRequest
from yaie.engine.model_runner import ModelRunner, RunnerOutput
from yaie.engine.output_processor import OutputProcessor, fail, unfinished_seqs
from yaie.engine.request import Choice, Request, check_priority, deadline_after
from yaie.engine.resources import (
    max_model_len,
    num_kv_blocks,
    resolve_device_and_dtype,
    resolve_kv_cache_dtype,
)
from yaie.engine.scheduler import Scheduler, SchedulerOutput
from yaie.engine.sequence import ANONYMOUS_TENANT, Sequence, SequenceStatus
from yaie.engine.step_log import StepLog
from yaie.engine.step_shape import StepShape, StepTotals
from yaie.errors import InvalidRequestError, RequestFailedError, YaieError
from yaie.model.loader import LoadProgress, load_model, resolve_model_path
from yaie.outputs import RequestOutput
from yaie.pooling_params import PoolingParams
from yaie.sampling.sampler import Sampler, SamplerOutput
from yaie.sampling_params import SamplingParams
from yaie.spec.config import SpeculativeConfig
from yaie.spec.decoder import SpecDecodeStats, SpeculativeDecoder
from yaie.spec.proposers import PROPOSERS, TargetInfo, TargetModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences
    num_waiting: int  # sequences waiting for admission (with n > 1 siblings waiting for the prompt)
    num_kv_blocks: int
    num_used_kv_blocks: int  # held by sequences
    num_cached_kv_blocks: int  # held only by the prefix cache: evictable, so in effect free
    kv_block_bytes: int
    num_preemptions: int
    num_computed_prompt_tokens: int  # prompt tokens actually run through the model (not cache hits)
    steps: StepTotals  # what the steps so far computed, and how long they took
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on

    @property
    def kv_cache_used_bytes(self) -> int:
        return self.num_used_kv_blocks * self.kv_block_bytes

    @property
    def kv_cache_cached_bytes(self) -> int:
        return self.num_cached_kv_blocks * self.kv_block_bytes

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks


@dataclass(frozen=True)
class ModelInfo:
    """What a server says about the model it serves."""

    path: Path
    architecture: str
    max_model_len: int
    vocab_size: int
    quantization: str  # the types the linear layers run in ("Q4_1, Q8_0", "int8"); "none": all dense
    kernel_isa: str  # the quantized kernels' ISA path (avx512vnni ... scalar); "none" if unused
    weight_bytes: int  # resident weight bytes
    kv_cache_dtype: str  # what the KV cache stores: "float32", "bfloat16", "float16"
    hidden_size: int  # the length of the model's hidden states, and so of its embeddings


class Engine:
    def __init__(self, config: EngineConfig | None = None, load_progress: LoadProgress | None = None) -> None:
        """`load_progress`: called with (tensors loaded, total) while the model loads."""
        self.config = config = config or EngineConfig()
        # Checked before anything loads, so a bad configuration leaves nothing half started.
        spec_config = None
        if config.speculative_config is not None:
            spec_config = SpeculativeConfig.from_dict(config.speculative_config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device, self.dtype = resolve_device_and_dtype(config.device, config.dtype)
        if self.device.type == "cpu":
            logger.info("CPU threads: %d", torch.get_num_threads())
        target_model = TargetModel(resolve_model_path(config.model), config.quantization, self.device)
        if spec_config is not None:  # what the method needs of the target, checked before it loads
            PROPOSERS[spec_config.method].check_target(spec_config, target_model)
        loaded = load_model(
            config.model, self.dtype, self.device, max_positions=config.max_model_len, progress=load_progress,
            quantization=config.quantization,
        )  # fmt: skip
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        quantized = loaded.quantization != "none"
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, quantized)
        self.kv_block_bytes = ModelRunner.bytes_per_block(loaded.config, config.block_size, self.kv_dtype)
        num_blocks = num_kv_blocks(config, self.device, self.kv_block_bytes)
        self.max_model_len = max_model_len(config, loaded.config, num_blocks)
        self.weight_bytes = loaded.weight_bytes
        self.model_info = ModelInfo(
            loaded.path, self.model_config.architecture, self.max_model_len, self.model_config.vocab_size,
            loaded.quantization, loaded.kernel_isa, loaded.weight_bytes,
            str(self.kv_dtype).removeprefix("torch."), self.model_config.hidden_size,
        )  # fmt: skip
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, self.kv_dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %.1f MiB", num_blocks, config.block_size,
            self.model_info.kv_cache_dtype, num_blocks * self.kv_block_bytes / 2**20,
        )  # fmt: skip
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.speculator: SpeculativeDecoder | None = None
        if spec_config is not None:
            target = TargetInfo(
                self.model_config.vocab_size, self.tokenizer, self.device, self.dtype, config.block_size,
                num_blocks, self.max_model_len, frozenset(self.eos_token_ids), target_model, quantized,
            )  # fmt: skip
            self.speculator = SpeculativeDecoder.create(spec_config, target)
        self.block_pool = BlockPool(num_blocks)
        prefix_cache = None
        if config.enable_prefix_caching:
            prefix_cache = RadixCache(self.block_pool, config.block_size)
        self.scheduler = Scheduler(
            self.block_pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            prefix_cache=prefix_cache, drafter=self.speculator, policy=config.scheduling_policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )  # fmt: skip
        logger.info("scheduling policy: %s", config.scheduling_policy)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len, self.eos_token_ids
        )
        self.sampler = Sampler(self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}  # the unfinished requests, by id
        self._failed: list[RequestOutput] = []  # outputs of requests failed since the last step's outputs
        self._ids = itertools.count()
        self.step_log = StepLog()  # records steps only while the engine view watches
        self.step_totals = StepTotals()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = ANONYMOUS_TENANT,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request, generating (SamplingParams) or pooling (PoolingParams: an embedding);
        returns its id. Raises InvalidRequestError for input we refuse. `priority`: lower runs
        first, under the priority scheduling policy (must be 0 under fcfs). `timeout`: seconds from
        now after which the request ends, finished or not, with finish_reason "timeout". `tenant`:
        who sent it: the engine is shared fairly between tenants (the scheduler's module
        docstring), and a tenant's prompts share the prefix cache only with its own, and with
        the same `cache_salt` (vLLM's)."""
        deadline = deadline_after(timeout)
        processed = self.input_processor.process(prompt, params or SamplingParams())
        return self.add_processed_request(
            request_id, processed, priority=priority, deadline=deadline, tenant=tenant, cache_salt=cache_salt
        )

    def add_processed_request(
        self,
        request_id: str | None,
        processed: ProcessedRequest,
        *,
        priority: int = 0,
        deadline: float | None = None,
        tenant: str = ANONYMOUS_TENANT,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request the input processor made ready (perhaps on another thread); returns
        its id. `deadline`: the time.monotonic() instant by which it ends (see add_request)."""
        check_priority(priority, self.config.scheduling_policy)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = self._new_request(request_id, processed, priority, tenant, cache_salt)
        request.deadline = deadline
        self.requests[request_id] = request
        seqs = [choice.seq for choice in request.choices]
        self.scheduler.add(seqs[0], siblings=seqs[1:])
        self.step_log.arrived(request_id)
        return request_id

    def _new_request(
        self, request_id: str, processed: ProcessedRequest, priority: int, tenant: str, cache_salt: str | None
    ) -> Request:
        """The request with its n choices: a sequence for the scheduler each, with its own
        grammar matcher and seeded generator where the request has them."""
        params, prompt_token_ids = processed.params, processed.prompt_token_ids
        if isinstance(params, PoolingParams):
            if params.pooling_type is None:
                params = replace(params, pooling_type=self.config.pooling)
            request = Request(
                request_id, processed.prompt, prompt_token_ids, params, priority=priority, tenant=tenant
            )
            seq = Sequence(
                f"{request_id}-0", prompt_token_ids, params, request_id, 0, priority, tenant, cache_salt
            )
            request.choices.append(Choice(seq, detokenizer=None))
            return request
        request = Request(
            request_id, processed.prompt, prompt_token_ids, params, priority=priority, tenant=tenant
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        for index in range(params.n):
            seq = Sequence(
                f"{request_id}-{index}", prompt_token_ids, params, request_id, index, priority, tenant,
                cache_salt,
            )  # fmt: skip
            if processed.grammar is not None:
                seq.grammar = processed.grammar.matcher()
            if params.seed is not None:
                # Any integer is a valid seed: fold it into the 64 bits a generator takes.
                seq.generator = torch.Generator(self.device).manual_seed((params.seed + index) % 2**64)
            request.choices.append(self.output_processor.new_choice(seq))
        return request

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template (InputProcessor.encode_chat)."""
        return self.input_processor.encode_chat(messages, tools)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; False if it is not (or no longer) running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq, status in unfinished_seqs(request).items():
            self.scheduler.finish(seq, status)
        return True

    def _expire(self) -> list[RequestOutput]:
        """End every request whose deadline has passed, waiting or running: its sequences are
        freed now, and its last output says finish_reason "timeout"."""
        now = time.monotonic()
        expired = [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]
        outputs = []
        for request in expired:
            for seq in unfinished_seqs(request):
                self.scheduler.finish(seq, SequenceStatus.FINISHED_TIMEOUT)
            del self.requests[request.request_id]
            outputs.append(self.output_processor.time_out(request))
        return outputs

    def _fail(self, request: Request, error: YaieError) -> None:
        """Finish a request with an error between two stages of a step: its sequences are freed
        now, and its last output, carrying `error`, goes out with the step's outputs."""
        self.abort(request.request_id)
        self._failed.append(fail(request, error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        pool = self.block_pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting(),
            num_kv_blocks=pool.num_blocks,
            num_used_kv_blocks=pool.num_used - pool.num_cached_only,
            num_cached_kv_blocks=pool.num_cached_only,
            kv_block_bytes=self.kv_block_bytes,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            steps=replace(self.step_totals),
            spec_decode=None if self.speculator is None else replace(self.speculator.stats),
        )

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> process outputs -> update (after ending the requests
        whose deadline has passed, so that their blocks are free for this step's plan)."""
        started = time.perf_counter()
        expired = self._expire()
        plan = self.scheduler.schedule()
        plan, model_output, sampled = self._forward(plan)  # run and sample, failing requests alone
        outputs, finished = self.output_processor.process(self.requests, plan, model_output, sampled)
        self.scheduler.update(plan, finished)
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        self._record(plan, started)
        outputs, self._failed = expired + outputs + self._failed, []
        return outputs

    def _record(self, plan: SchedulerOutput, started: float) -> None:
        """Count the step: speculation's acceptance, the step totals, the engine view's log."""
        if self.speculator is not None:
            self.speculator.record(plan)
        shape = StepShape.of(plan.scheduled)
        if shape.num_tokens:
            self.step_totals.add(shape, time.perf_counter() - started)
        if self.step_log.watched:
            self.step_log.record(
                plan, sum(item.num_appended_tokens() for item in plan.scheduled), started, self.scheduler
            )

    def _forward(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, RunnerOutput, SamplerOutput]:
        """Run the model and draw the next tokens for the plan.

        Neither touches a sequence's state (the K/V slots they write are written again, with
        the same values, if a sequence runs again), so when the plan fails it can be redone
        sequence by sequence: the one that still fails alone fails its request only, and is
        dropped from the plan (with its request's other choices); everyone else gets exactly
        the tokens the whole plan would have given them (seeded generators are rewound to where
        the step began). Returns the plan that ran, with its results."""
        seeded = [(s.generator, s.generator.get_state()) for s in plan.sampling_seqs if s.generator]
        try:
            return (plan, *self._forward_plan(plan))
        except InvalidRequestError as exc:  # a request's own input: no failure of ours to trace
            logger.warning(
                "a step of %d sequences failed (%s); retrying one at a time", len(plan.scheduled), exc
            )
        except Exception:
            logger.exception("a step of %d sequences failed; retrying one at a time", len(plan.scheduled))
        for generator, state in seeded:
            generator.set_state(state)
        results = []
        for item in plan.scheduled:
            try:
                results.append((item, self._forward_plan(SchedulerOutput((item,)))))
            except Exception as exc:
                error: YaieError
                if isinstance(exc, InvalidRequestError):
                    logger.warning("request %s failed on its input: %s", item.seq.request_id, exc)
                    error = exc
                else:
                    logger.exception("sequence %s failed alone: failing its request", item.seq.seq_id)
                    error = RequestFailedError(f"the engine failed on this request: {exc!r}")
                request = self.requests.get(item.seq.request_id)
                if request is not None:
                    self._fail(request, error)
        # A failed request's other choices may have run fine: they go too.
        kept = [(item, result) for item, result in results if item.seq.request_id in self.requests]
        runs = [result for _, result in kept]
        logits = [model_output.logits for model_output, _ in runs]
        model_output = RunnerOutput(
            torch.cat(logits) if logits else torch.empty(0, self.model_config.vocab_size, device=self.device),
            [entry for model_output, _ in runs for entry in model_output.prompt_logits],
            [entry for model_output, _ in runs for entry in model_output.pooled],
        )
        sampled = SamplerOutput.concat(sampled for _, sampled in runs)
        return replace(plan, scheduled=tuple(item for item, _ in kept)), model_output, sampled

    def _forward_plan(self, plan: SchedulerOutput) -> tuple[RunnerOutput, SamplerOutput]:
        model_output = self.runner.execute(plan)
        if self.speculator is not None and plan.has_drafts:
            return model_output, self.speculator.sample(plan, model_output.logits, self.sampler)
        sampling_batch = self.sampler.prepare(plan.sampling_seqs, self.device)
        return model_output, self.sampler.sample(model_output.logits, sampling_batch)
