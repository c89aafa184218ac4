"""The engine: requests in, outputs out, one `step()` at a time.

    step() = scheduler.schedule() -> runner.execute() -> sampler.sample()
             -> output_processor.process() -> scheduler.update()

With speculative decoding on (yaie.spec), a propose stage follows the schedule and the
decoding sequences' drafts are verified instead of sampled; see yaie/spec/decoder.py.

The scheduler picks which sequences compute which tokens, the runner runs them through the model,
the sampler draws each sampling sequence's next token, the output processor appends the tokens,
applies the stop rules and makes the outputs, and the scheduler records the step (KV progress,
finished sequences released). The engine is synchronous and single-threaded; `LLM` loops over
it, the async server drives it from a background thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.config import EngineConfig
from yaie.engine.model_runner import ModelRunner, RunnerOutput
from yaie.engine.output_processor import OutputProcessor
from yaie.engine.scheduler import Scheduler, SchedulerOutput
from yaie.engine.sequence import SequenceStatus
from yaie.engine.step_log import StepLog
from yaie.engine.step_shape import StepShape, StepTotals
from yaie.errors import InvalidRequestError
from yaie.model.loader import LoadProgress, load_model, resolve_model_path
from yaie.outputs import RequestOutput
from yaie.sampling.sampler import Sampler, SamplerOutput
from yaie.sampling_params import SamplingParams
from yaie.spec.config import SpeculativeConfig
from yaie.spec.decoder import SpecDecodeStats, SpeculativeDecoder
from yaie.spec.proposers import PROPOSERS, TargetInfo, TargetModel
from yaie.spec.verify import StepTokens
from yaie.structured.backend import Grammar, GrammarCompiler
from yaie.structured.spec import StructuredOutputs
from yaie.structured.tools import hermes_messages, template_knows_tools

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 2 << 30  # ~45k tokens of SmolLM2-135M in fp32; zeroing it costs ~1 s
DEFAULT_GPU_KV_FRACTION = 0.85


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences
    num_waiting: int  # sequences waiting for admission
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


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The KV cache's element type for a KV_CACHE_DTYPES name (EngineConfig checked it).

    "auto" is `dtype`, the model's compute dtype, except under quantized weights computing in
    float32: there float16, as llama.cpp's default cache. The weights are rounded far more than
    16 bits round K/V (the bundled Q4_1 model's perplexity moved by 0.07% with a float16 cache:
    benchmarks/perplexity.py --kv-cache-dtype, README), and at many sequences decode attention
    reads the whole cache every step, so half the bytes make a faster step. float16 rather than
    bfloat16 for its three more significand bits. Dense weights keep their own dtype:
    `--quantization none` is exact transformers parity.
    """
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized and dtype == torch.float32 else dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[kv_cache_dtype]


def default_kv_cache_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_KV_FRACTION)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP)


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
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer

        quantized = loaded.quantization != "none"
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, quantized)
        block_bytes = ModelRunner.bytes_per_block(loaded.config, config.block_size, self.kv_dtype)
        num_blocks = (
            config.num_kv_blocks
            or (config.kv_cache_memory or default_kv_cache_memory(self.device)) // block_bytes
        )
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget is smaller than one block ({block_bytes} bytes)")
        self.kv_block_bytes = block_bytes
        self.max_model_len = self._max_model_len(num_blocks)
        self.weight_bytes = loaded.weight_bytes
        self.model_info = ModelInfo(
            loaded.path, self.model_config.architecture, self.max_model_len, self.model_config.vocab_size,
            loaded.quantization, loaded.kernel_isa, loaded.weight_bytes,
            str(self.kv_dtype).removeprefix("torch."),
        )  # fmt: skip
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, self.kv_dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %.1f MiB",
            num_blocks, config.block_size, self.model_info.kv_cache_dtype, num_blocks * block_bytes / 2**20,
        )  # fmt: skip
        self.block_pool = BlockPool(num_blocks)
        prefix_cache = None
        if config.enable_prefix_caching:
            prefix_cache = RadixCache(self.block_pool, config.block_size)
        self.scheduler = Scheduler(
            self.block_pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            prefix_cache=prefix_cache,
        )  # fmt: skip
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.speculator: SpeculativeDecoder | None = None
        if spec_config is not None:
            target = TargetInfo(
                self.model_config.vocab_size, self.tokenizer, self.device, self.dtype, config.block_size,
                num_blocks, self.max_model_len, frozenset(self.eos_token_ids),
                target_model, quantized,
            )  # fmt: skip
            self.speculator = SpeculativeDecoder.create(spec_config, target, self.scheduler)
        self.sampler = Sampler(self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first structured request
        self._grammar_compiler_lock = threading.Lock()
        self.step_log = StepLog()  # records steps only while the engine view watches
        self.step_totals = StepTotals()

    def _max_model_len(self, num_blocks: int) -> int:
        cfg = self.model_config
        limit = self.config.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window:  # we attend to the whole context, which is exact only inside the window
            limit = min(limit, cfg.sliding_window)
        capacity = num_blocks * self.config.block_size
        if capacity < limit:
            logger.warning("KV cache holds %d tokens; limiting max_model_len from %d", capacity, limit)
        return min(limit, capacity)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for input we refuse."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        self._check_request(token_ids, params)
        grammar = self.compile_grammar(params.structured_outputs) if params.structured_outputs else None
        request = self.output_processor.new_request(request_id, text, token_ids, params)
        seqs = [choice.seq for choice in request.choices]
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar.matcher()
        if params.seed is not None:
            for seq in seqs:
                # Any integer is a valid seed: fold it into the 64 bits a generator takes.
                seq.generator = torch.Generator(self.device).manual_seed((params.seed + seq.index) % 2**64)
        self.scheduler.add(seqs[0], siblings=seqs[1:])
        self.step_log.arrived(request_id)
        return request_id

    def compile_grammar(self, spec: StructuredOutputs) -> Grammar:
        """The compiled grammar for `spec`, cached; raises InvalidRequestError for one the grammar
        library refuses. Thread-safe: the server calls it off the engine thread before adding a
        request, so that compiling a new schema never holds up a step, and `add_request` then
        finds it cached."""
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
        return self._grammar_compiler.compile(spec)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a conversation through the model's own chat template, ready to answer.
        `tools` (OpenAI tool definitions) go to a template that renders them; for one that does
        not, they, the calls and the tool results are written in the Hermes style
        (yaie/structured/tools.py)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template; use a plain prompt", "messages")
        extra: dict[str, Any] = {}
        if template_knows_tools(template):
            extra = {"tools": tools} if tools else {}
        elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = hermes_messages(messages, tools)
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **extra
            )
        except TemplateError as exc:  # templates raise on conversations they do not accept
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """What only the model knows: the vocabulary and the context length. (SamplingParams
        checks its own values.) This is the one place token ids are checked against the vocabulary."""
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
        """Stop a request and free its KV blocks now; False if it is not (or no longer) running."""
        request = self.output_processor.pop(request_id)
        if request is None:
            return False
        for choice in request.choices:
            if not choice.seq.status.finished:
                self.scheduler.finish(choice.seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def stats(self) -> EngineStats:
        pool = self.block_pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
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
        watched, started = self.step_log.watched, time.perf_counter()
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.propose(batch)
        model_output, sampled = self._forward(batch)
        outputs = self.output_processor.process(batch, model_output, sampled)
        if self.speculator is not None:
            self.speculator.record(batch)
        # Counted before the update moves the counts they are computed from.
        generated = sum(item.num_generated_tokens() for item in batch.scheduled) if watched else 0
        shape = StepShape.of(batch.scheduled)
        self.scheduler.update(batch)
        if shape.num_tokens:
            self.step_totals.add(shape, time.perf_counter() - started)
        if watched:
            self.step_log.record(batch, generated, started, self.scheduler)
        return outputs

    def _forward(self, batch: SchedulerOutput) -> tuple[RunnerOutput, SamplerOutput | StepTokens]:
        """Run the model and draw the next tokens for the batch.

        Neither touches a sequence's state (the K/V slots they write are written again, with
        the same values, if a sequence runs again), so when the batch fails it can be redone
        sequence by sequence: the one that still fails alone fails its request only, and is
        dropped from the batch; everyone else gets exactly the tokens the whole batch would
        have given them (seeded generators are rewound to where the step began)."""
        seeded = [(s.generator, s.generator.get_state()) for s in batch.sampling_seqs if s.generator]
        try:
            return self._forward_batch(batch)
        except Exception:
            logger.exception("a step of %d sequences failed; retrying one at a time", len(batch.scheduled))
        for generator, state in seeded:
            generator.set_state(state)
        survivors, results = [], []
        for item in batch.scheduled:
            try:
                results.append(self._forward_batch(SchedulerOutput([item], [])))
                survivors.append(item)
            except Exception as exc:
                request_id = item.seq.request_id
                logger.exception("sequence %s failed alone: failing its request", item.seq.seq_id)
                self.output_processor.fail(request_id, f"the engine failed on this request: {exc!r}")
        # A failed request's other choices may have run fine: they go too.
        kept = [
            (item, out)
            for item, out in zip(survivors, results, strict=True)
            if not item.seq.status.finished
        ]
        batch.scheduled = [item for item, _ in kept]
        return merge_forward_results([out for _, out in kept], self.device, self.model_config.vocab_size)

    def _forward_batch(self, batch: SchedulerOutput) -> tuple[RunnerOutput, SamplerOutput | StepTokens]:
        model_output = self.runner.execute(batch)
        if self.speculator is not None and self.speculator.speculating:
            return model_output, self.speculator.sample(batch, model_output.logits, self.sampler, self.device)
        sampling_batch = self.sampler.prepare(batch.sampling_seqs, self.device)
        return model_output, self.sampler.sample(model_output.logits, sampling_batch)


def merge_forward_results(
    results: list[tuple[RunnerOutput, SamplerOutput | StepTokens]], device: torch.device, vocab_size: int
) -> tuple[RunnerOutput, SamplerOutput | StepTokens]:
    """One batch's results from those of its parts, in order."""
    logits = [runner.logits for runner, _ in results]
    model_output = RunnerOutput(
        torch.cat(logits) if logits else torch.empty(0, vocab_size, device=device),
        [entry for runner, _ in results for entry in runner.prompt_logits],
    )
    parts = [sampled for _, sampled in results]
    plain = [sampled for sampled in parts if isinstance(sampled, SamplerOutput)]
    if len(plain) < len(parts):  # a speculative step
        return model_output, StepTokens.concat(parts)
    token_ids = [token for sampled in plain for token in sampled.token_ids]
    logprobs = None
    if any(sampled.logprobs is not None for sampled in plain):
        none: list[Any] = [None]
        logprobs = [
            entry for sampled in plain for entry in (sampled.logprobs or none * len(sampled.token_ids))
        ]
    return model_output, SamplerOutput(token_ids, logprobs)
