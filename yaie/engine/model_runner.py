"""ModelRunner: owns the model and the KV cache tensor; turns a step's plan into logits.

`execute(plan)` builds the step's input tensors and `AttentionMetadata` from the plan (what each
sequence computes, fixed when the step was planned), runs the model once, and projects only the
rows someone needs through the LM head. A pooling sequence needs no logits: it gets its part of
the final hidden states instead (yaie/pooling_params.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from yaie.engine.scheduler import ScheduledSequence, SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.model.attention import AttentionMetadata, PrefillSeq
from yaie.model.config import ModelConfig
from yaie.model.fused_decode import FusedDecode
from yaie.model.llama import CausalLM


@dataclass
class RunnerOutput:
    # [rows, vocab], in batch order: one row per sequence that samples this step, or 1 + k rows
    # for one verifying k draft tokens (its predictions after its last token and after each draft).
    logits: torch.Tensor
    # For sequences that want prompt logprobs: (sequence, first target position, logits) where
    # logits row i is the prediction of prompt token `first target position + i`.
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    # Pooling sequences' part of the final hidden states, [hidden] in float32 each: the sum of
    # the step's rows (mean pooling, summed across chunks by the output processor), or the last
    # prompt row (last pooling, only in the step that reaches it).
    pooled: list[tuple[ScheduledSequence, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: list[int]  # the last row of each sequence that samples (1 + k, with k drafts)
    prompt_rows: list[tuple[Sequence, int, int, int]]  # (sequence, first target, first row, rows)
    pooling_rows: list[tuple[ScheduledSequence, int, int]]  # (a pooling sequence's part, first row, rows)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """`kv_dtype`: what the cache stores; attention converts to and from the model's dtype."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = model.device
        # One tensor for the whole cache: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=kv_dtype, device=self.device,
        )  # fmt: skip
        model.bind_kv_cache(self.kv_cache)
        # The native decode path over every layer, where the model has one for this cache: chosen
        # here, once; `execute` takes it for each step it fits.
        self.fused_decode = FusedDecode.for_model(model)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one forward over every scheduled token and project the rows someone needs."""
        if not plan.scheduled:  # nothing could be admitted this step
            return RunnerOutput(torch.empty(0, self.model.config.vocab_size, device=self.device))
        inputs = self._prepare(plan)
        if self.fused_decode is not None and self.fused_decode.fits(inputs.meta):
            hidden = self.fused_decode(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        # The LM head is the costliest matmul of a decode step: run it only on wanted rows.
        rows = inputs.logits_rows + [
            r for _, _, first, count in inputs.prompt_rows for r in range(first, first + count)
        ]
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        sampled, rest = logits[: len(inputs.logits_rows)], logits[len(inputs.logits_rows) :]
        prompt_logits = []
        for seq, first_target, _, count in inputs.prompt_rows:
            prompt_logits.append((seq, first_target, rest[:count]))
            rest = rest[count:]
        pooled = [
            (item, hidden[first : first + count].float().sum(0)) for item, first, count in inputs.pooling_rows
        ]
        return RunnerOutput(sampled, prompt_logits, pooled)

    def _prepare(self, plan: SchedulerOutput) -> _Inputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        pooling_rows: list[tuple[ScheduledSequence, int, int]] = []
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            done, table = item.num_computed_tokens, seq.block_table
            start = len(input_ids)
            if item.spec_token_ids:
                input_ids.extend((seq.all_token_ids + list(item.spec_token_ids))[done : done + n])
            else:
                input_ids.extend(seq.all_token_ids[done : done + n])
            positions.extend(range(done, done + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(done, done + n))
            if n == 1 and done > 0:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(done + 1)
            elif done == 0:
                prefills.append(PrefillSeq(start, n))
            else:
                prefills.append(self._prefill_with_context(start, n, done, table))
            if item.samples:
                logits_rows.extend(range(start + n - 1 - len(item.spec_token_ids), start + n))
            pooling = seq.pooling_params
            if pooling is not None:
                if pooling.pooling_type == "mean":
                    pooling_rows.append((item, start, n))
                elif item.pools:
                    pooling_rows.append((item, start + n - 1, 1))
                continue
            # Row p predicts token p + 1; prompt logprobs want those predictions inside the prompt.
            wants_prompt = seq.sampling_params.prompt_logprobs is not None
            last = min(done + n, seq.num_prompt_tokens - 1)
            if wants_prompt and done < last:
                prompt_rows.append((seq, done + 1, start, last - done))

        meta = AttentionMetadata(slot_mapping=self._tensor(slots), prefills=prefills)
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_block_tables = self._tensor(padded)
            meta.decode_context_lens = self._tensor(decode_lens)
            if len(decode_rows) != len(input_ids):
                meta.decode_token_idx = self._tensor(decode_rows)
        return _Inputs(
            self._tensor(input_ids), self._tensor(positions), meta, logits_rows, prompt_rows, pooling_rows
        )

    def _prefill_with_context(self, start: int, n: int, done: int, table: list[int]) -> PrefillSeq:
        """A chunk whose first `done` tokens are cached: attention reads them through the blocks
        that hold them."""
        blocks = self._tensor(table[: -(-done // self.block_size)])
        return PrefillSeq(start, n, num_cached=done, block_table=blocks)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
