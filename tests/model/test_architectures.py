"""Our model against transformers' own, on tiny random checkpoints of each architecture.

Prefill logits at every position, then 16 greedy decode steps through the paged KV cache
(with the prompt split into chunks that cross block boundaries), all within 1e-4 in fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.tiny_models import ARCHITECTURES, make_tiny_model
from yaie.cache.block_pool import BlockPool
from yaie.engine.model_runner import ModelRunner
from yaie.engine.scheduler import ScheduledSequence, SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.errors import UnsupportedModelError
from yaie.model.attention import AttentionMetadata, PrefillSeq
from yaie.model.loader import load_model
from yaie.sampling_params import SamplingParams

ATOL = 1e-4
BLOCK = 4


@pytest.mark.parametrize("kernels", ["native", "pytorch"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_logits_match_transformers(kind, kernels, tmp_path, request):
    request.getfixturevalue("native_kernels" if kernels == "native" else "pytorch_only")
    hf = make_tiny_model(kind, tmp_path)
    ours = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    prompt = list(range(3, 14))

    # 1. Prefill logits at every prompt position, straight through the model.
    runner = ModelRunner(ours.model, num_blocks=32, block_size=BLOCK, kv_dtype=torch.float32)
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n)])
    with torch.inference_mode():
        logits = ours.model.compute_logits(ours.model(torch.tensor(prompt), torch.arange(n), meta))
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)

    # 2. The same prompt in two chunks through the paged cache, then 16 decode steps.
    pool = BlockPool(32)
    request = Sequence("r", prompt, SamplingParams(max_tokens=16))
    tokens = list(prompt)
    for step, chunk in enumerate([5, n - 5] + [1] * 16):
        needed = -(-(request.num_computed_tokens + chunk) // BLOCK) - len(request.block_table)
        request.block_table += pool.allocate(max(0, needed))
        item = ScheduledSequence(request, chunk)
        samples = item.samples
        logits = runner.execute(SchedulerOutput([item], [])).logits
        request.num_computed_tokens += chunk
        if not samples:
            assert logits.shape[0] == 0 and step == 0
            continue
        with torch.inference_mode():
            expected = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)
        next_token = int(expected.argmax())
        tokens.append(next_token)
        request.append_token(next_token)


def test_unsupported_architecture_is_named(tmp_path):
    make_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kernels", ["native", "pytorch"])
def test_bfloat16_follows_float32(kernels, tmp_path, request):
    # bf16 keeps ~3 significant digits, so compare against transformers' fp32 logits loosely,
    # and demand the same greedy choice at every position. On CPUs with bf16 dot products the
    # linears run through oneDNN's packed path, elsewhere through F.linear: both are covered.
    request.getfixturevalue("native_kernels" if kernels == "native" else "pytorch_only")
    hf = make_tiny_model("llama", tmp_path)
    ours = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner(ours.model, num_blocks=32, block_size=BLOCK, kv_dtype=torch.bfloat16)
    prompt = list(range(3, 30))
    pool = BlockPool(32)
    request_ = Sequence("r", prompt, SamplingParams(max_tokens=8))
    request_.block_table = pool.allocate(-(-(len(prompt) + 8) // BLOCK))
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    logits = runner.execute(SchedulerOutput([ScheduledSequence(request_, len(prompt))], [])).logits[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)
    assert int(logits.argmax()) == int(expected.argmax())
