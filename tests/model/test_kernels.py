"""The native CPU kernels against plain PyTorch: decode attention over the paged KV cache (and
the PyTorch path that replaces it) against attention over each sequence's keys laid out densely;
the fused residual add + RMSNorm, the in-place RoPE, the KV write and the greedy argmax against
the ops they replace; a prompt chunk after cached tokens, both ways it is computed, against
textbook attention. Every path that touches the cache runs with each KV cache dtype."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from yaie.model.attention import (
    AttentionMetadata,
    PrefillSeq,
    _attend_after_cache,
    _attend_after_cache_masked,
    paged_attention,
)
from yaie.model.llama import RotaryEmbedding, rope_inv_freq
from yaie.ops import kernels, select_ops

NUM_BLOCKS = 64
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dense_reference(q, k_cache, v_cache, tables, lens):
    """Each sequence's keys gathered token by token, then textbook attention in float64."""
    block_size, head_dim = k_cache.shape[1], q.shape[-1]
    group = q.shape[1] // k_cache.shape[2]
    out = []
    for seq, length in enumerate(lens.tolist()):
        slots = [(int(tables[seq, t // block_size]), t % block_size) for t in range(length)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double().repeat_interleave(group, dim=1)
        v = torch.stack([v_cache[b, o] for b, o in slots]).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].double(), k) / head_dim**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def make_case(num_seqs, heads, kv_heads, head_dim, block_size, max_len, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    lens[0] = max_len
    max_blocks = -(-max_len // block_size)
    # Every sequence's blocks are scattered over the cache; table entries past a sequence's end
    # point at blocks that belong to others, which it must not read.
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:max_blocks] for _ in range(num_seqs)])
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens


CASES = [
    # seqs, heads, kv_heads, head_dim, block_size, max context
    (8, 9, 3, 64, 16, 170),  # the bundled model's shape (GQA, groups of 3)
    (1, 9, 3, 64, 16, 1000),  # several 64-token splits, merged
    (3, 8, 2, 64, 16, 90),  # groups of 4 (with AVX-512, each group's heads go together)
    (2, 2, 2, 64, 8, 33),  # groups of 1
    (2, 10, 2, 64, 16, 40),  # groups of 5: more than AVX-512's grouped loops take
    (3, 4, 4, 32, 16, 1),  # one token of context
    (5, 8, 2, 128, 32, 700),  # head_dim 128, wider blocks
    (4, 6, 1, 16, 1, 40),  # block size 1, one KV head (MQA)
    (2, 4, 2, 8, 4, 64),  # context exactly filling its blocks
    (3, 6, 3, 12, 8, 50),  # a token's row of 36 values: not a multiple of the SIMD width
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_decode_attention_matches_dense_attention(case, path, kv_dtype, request):
    """An fp32 query over a cache of each dtype. The reference reads the same stored values, and
    both paths widen them to fp32 before any maths, so the bound is fp32's whatever the cache."""
    ops = request.getfixturevalue("native_ops" if path == "native" else "pytorch_only")
    q, k_cache, v_cache, tables, lens = make_case(*case, dtype=torch.float32)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        prefills=[],
        decode_block_tables=tables,
        decode_context_lens=lens,
    )
    empty = q.new_empty(0, k_cache.shape[2], q.shape[-1])
    out = paged_attention(ops, q, empty, empty, k_cache, v_cache, meta)
    assert out.dtype == q.dtype
    torch.testing.assert_close(
        out.double(), dense_reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_native_kernel_in_half_precision(dtype, kv_dtype, native_kernels):
    q, k_cache, v_cache, tables, lens = make_case(4, 9, 3, 64, 16, 600, dtype)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5)
    assert out.dtype == dtype
    expected = dense_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)


def test_native_kernel_refuses_a_context_longer_than_its_table(native_kernels):
    q, k_cache, v_cache, tables, lens = make_case(2, 4, 2, 16, 4, 8, torch.float32)
    lens[1] = tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)


@pytest.mark.parametrize("rows", [1, 8, 300])  # 300 rows run on several threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_add_then_rms_norm(rows, dtype, native_kernels):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    expected_residual = (x.float() + residual.float()).to(dtype)
    expected = torch.nn.functional.rms_norm(expected_residual.float(), (576,), weight.float(), 1e-5)
    out = kernels.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # updated in place
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 8, 300])  # 300 rows run on several threads
@pytest.mark.parametrize("intermediate", [1536, 37])  # 37: no whole SIMD vector at the end
def test_silu_and_mul_is_within_an_ulp_of_pytorch(rows, intermediate, native_kernels):
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen) * 6  # well into both tails
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-30])  # exp overflows; silu ~ 0 or x
    gate, up = gate_up.split(intermediate, dim=-1)
    out = kernels.silu_and_mul(gate_up)
    assert out.shape == (rows, intermediate)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [0, 1, 8, 33])  # 33: several threads, one row more than even
@pytest.mark.parametrize("vocab", [49152, 1000, 1])  # 1000: the last stretch of 64 values is short
def test_argmax_rows_gives_torch_argmax(rows, vocab, native_kernels):
    gen = torch.Generator().manual_seed(rows * vocab + 1)
    logits = torch.randn(rows, vocab, generator=gen) * 10
    if rows >= 8 and vocab > 1:
        last = vocab - 1
        logits[0, [5 % vocab, last]] = 1e3  # tied maxima: the first wins
        logits[1, : last + 1 : 2] = 7.0  # a tie in every other stretch
        logits[1, 1::2] = -7.0
        logits[2] = -float("inf")  # nothing better than -inf: index 0
        logits[3, last] = float("inf")
        logits[4, [3, last]] = float("nan")  # a NaN counts as the largest: the first NaN
        logits[4, 0] = float("inf")
        logits[5] = 0.0
        logits[5, 0] = -0.0  # equal to 0.0: the first index
        logits[6, 0] = float("nan")
        logits[7, 64 % vocab] = 1e6  # the maximum starts a stretch
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))


def strided_heads(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] as a slice of a wider buffer, like q and k inside the qkv output."""
    buffer = torch.randn(tokens, heads + 3, head_dim, generator=torch.Generator().manual_seed(tokens))
    return buffer.to(dtype)[:, 1 : heads + 1]


@pytest.mark.parametrize("tokens", [1, 8, 500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_pytorch_rope(tokens, dtype, native_kernels):
    rope = RotaryEmbedding(64, 1024, rope_inv_freq(64, 10000.0, None))
    positions = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(1))
    cos, sin = rope(positions, dtype)
    x = strided_heads(tokens, 12, 64, dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    expected = torch.cat((x1, x2), dim=-1) * cos.float() + torch.cat((x2, x1), dim=-1) * sin.float()
    untouched = x.float().clone()
    out = kernels.apply_rope_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # in place
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.float(), expected, atol=tolerance, rtol=tolerance)
    assert not torch.equal(x.float(), untouched)


@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_every_backend_writes_the_same_tensors_in_place(path, request):
    """add_rms_norm updates the residual and apply_rope_ the heads in place, in both backends,
    and their results agree with each other: a model runs on either without knowing which."""
    ops = request.getfixturevalue("native_ops" if path == "native" else "pytorch_only")
    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, 8, 576, generator=gen)
    weight = torch.rand(576, generator=gen)
    expected_residual = x + residual
    out = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(expected_residual, (576,), weight, 1e-5))

    rope = RotaryEmbedding(64, 1024, rope_inv_freq(64, 10000.0, None))
    cos, sin = rope(torch.arange(8), torch.float32)
    heads = strided_heads(8, 12, 64, torch.float32)
    x1, x2 = heads.chunk(2, dim=-1)
    expected = heads * cos + torch.cat((x2, x1), dim=-1) * sin
    assert ops.apply_rope_(heads, cos, sin) is None
    torch.testing.assert_close(heads, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_the_chosen_backend_is_logged(path, request, caplog):
    request.getfixturevalue("native_kernels" if path == "native" else "pytorch_only")
    with caplog.at_level(logging.INFO, logger="yaie.ops"):
        ops = select_ops(torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [f"op backend: {ops.name}"]
    assert ops.name.startswith("native (" if path == "native" else "torch")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 13])  # 3 x 13 values a token: an odd row
def test_write_kv_matches_index_copy(head_dim, dtype, kv_dtype, native_kernels):
    """Into a cache of another dtype, each value is rounded exactly as `Tensor.to` rounds it."""
    k, v = strided_heads(7, 3, head_dim, dtype), strided_heads(7, 3, head_dim, dtype) + 1
    k_cache, v_cache = torch.zeros(2, NUM_BLOCKS, 4, 3, head_dim, dtype=kv_dtype)
    slots = torch.tensor([5, 0, 255, 17, 18, 100, 3])
    kernels.write_kv(k, v, slots, k_cache, v_cache)
    expected_k, expected_v = torch.zeros(2, NUM_BLOCKS * 4, 3, head_dim, dtype=kv_dtype)
    expected_k.index_copy_(0, slots, k.to(kv_dtype))
    expected_v.index_copy_(0, slots, v.to(kv_dtype))
    torch.testing.assert_close(k_cache.view(-1, 3, head_dim), expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.view(-1, 3, head_dim), expected_v, atol=0, rtol=0)


def test_write_kv_refuses_a_slot_outside_the_cache(native_kernels):
    k = torch.zeros(1, 3, 16)
    k_cache, v_cache = torch.zeros(2, NUM_BLOCKS, 4, 3, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv(k, k, torch.tensor([NUM_BLOCKS * 4]), k_cache, v_cache)


def test_decode_kernel_reads_strided_queries(native_kernels):
    q, k_cache, v_cache, tables, lens = make_case(4, 9, 3, 64, 16, 300, torch.float32)
    wide = torch.zeros(4, 15, 64)
    wide[:, 3:12] = q
    out = kernels.paged_decode_attention(wide[:, 3:12], k_cache, v_cache, tables, lens, 64**-0.5)
    torch.testing.assert_close(
        out.double(), dense_reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("attend", [_attend_after_cache, _attend_after_cache_masked])
@pytest.mark.parametrize("num_cached", [1, 37, 300])
def test_chunk_after_cache_attends_to_the_cache_and_causally_to_itself(attend, num_cached):
    gen = torch.Generator().manual_seed(num_cached)
    n, heads, kv_heads, dim = 23, 6, 2, 32
    q = torch.randn(1, heads, n, dim, generator=gen)
    keys, values = torch.randn(2, 1, kv_heads, num_cached + n, dim, generator=gen)
    out = attend(
        q,
        keys[:, :, :num_cached],
        values[:, :, :num_cached],
        keys[:, :, num_cached:],
        values[:, :, num_cached:],
    )
    # Query i sits at position num_cached + i and sees keys 0 .. num_cached + i.
    k64 = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v64 = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = q.double() @ k64.transpose(-1, -2) / dim**0.5
    visible = torch.arange(num_cached + n) <= torch.arange(num_cached, num_cached + n).unsqueeze(1)
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v64
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_prompt_chunk_after_cached_tokens_reads_the_cache_in_its_dtype(path, kv_dtype, request):
    """A chunk of 11 fp32 tokens after 37 cached ones: it writes its own K/V into the cache
    (rounded to the cache's dtype) and attends to the cached tokens as stored, widened to fp32,
    and to its own at full precision. The maths is fp32, so the bound is fp32's."""
    ops = request.getfixturevalue("native_ops" if path == "native" else "pytorch_only")
    gen = torch.Generator().manual_seed(3)
    num_cached, n, heads, kv_heads, dim, block_size = 37, 11, 6, 2, 12, 8
    keys, values = torch.randn(2, num_cached + n, kv_heads, dim, generator=gen)
    q = torch.randn(n, heads, dim, generator=gen)
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-(num_cached + n) // block_size)]
    positions = torch.arange(num_cached + n)
    slots = table[positions // block_size] * block_size + positions % block_size
    k_cache, v_cache = torch.zeros(2, NUM_BLOCKS, block_size, kv_heads, dim, dtype=kv_dtype)
    # The earlier tokens, as the steps that computed them left them.
    k_cache.view(-1, kv_heads, dim)[slots[:num_cached]] = keys[:num_cached].to(kv_dtype)
    v_cache.view(-1, kv_heads, dim)[slots[:num_cached]] = values[:num_cached].to(kv_dtype)
    cached_blocks = table[: -(-num_cached // block_size)]
    meta = AttentionMetadata(
        slot_mapping=slots[num_cached:],
        prefills=[PrefillSeq(0, n, num_cached=num_cached, block_table=cached_blocks)],
    )
    out = paged_attention(ops, q, keys[num_cached:], values[num_cached:], k_cache, v_cache, meta)

    assert out.dtype == torch.float32
    seen_k = torch.cat((keys[:num_cached].to(kv_dtype).double(), keys[num_cached:].double()))
    seen_v = torch.cat((values[:num_cached].to(kv_dtype).double(), values[num_cached:].double()))
    seen_k, seen_v = (x.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for x in (seen_k, seen_v))
    scores = q.double().transpose(0, 1) @ seen_k.transpose(-1, -2) / dim**0.5  # [heads, n, keys]
    visible = positions <= torch.arange(num_cached, num_cached + n).unsqueeze(1)
    expected = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ seen_v).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    written = slots[num_cached:]
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[written], keys[num_cached:].to(kv_dtype))
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[written], values[num_cached:].to(kv_dtype))


# --- the build cache key ---------------------------------------------------------------------------

X86_CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n"
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd aes sve\nCPU implementer\t: 0x41\n"


def test_cpus_with_different_flags_get_different_builds():
    avx512 = X86_CPUINFO.replace("avx2", "avx2 avx512f")
    assert kernels.cpu_key(X86_CPUINFO, "x86_64") != kernels.cpu_key(avx512, "x86_64")
    assert kernels.cpu_key(ARM_CPUINFO, "aarch64") != kernels.cpu_key(
        ARM_CPUINFO.replace(" sve", ""), "aarch64"
    )


def test_cpus_with_the_same_flags_share_a_build():
    reordered = X86_CPUINFO.replace("fpu sse2 avx2 fma", "fma avx2 fpu sse2")
    assert kernels.cpu_key(X86_CPUINFO, "x86_64") == kernels.cpu_key(reordered, "x86_64")
    # Lines other than the flags (model name, MHz, core count) do not matter.
    assert kernels.cpu_key(X86_CPUINFO, "x86_64") == kernels.cpu_key(
        X86_CPUINFO.replace("GenuineIntel", "AuthenticAMD") + "processor\t: 2\n", "x86_64"
    )


def test_the_architecture_is_part_of_the_key():
    assert kernels.cpu_key("", "x86_64") != kernels.cpu_key("", "aarch64")


def test_this_machine_builds_under_its_cpu_key():
    name = kernels.extension_name()
    assert name.startswith("yaie_kernels_") and name.isidentifier()
    assert name == kernels.extension_name()


def test_a_build_killed_midway_does_not_hang_the_next_start(native_kernels):
    """A first start stopped while compiling leaves torch's `lock` file in the build directory;
    torch alone would wait on it forever at every later start. The timeout only ends the wait
    of the failing case: a built extension loads in a few seconds."""
    lock = Path(cpp_extension._get_build_directory(kernels.extension_name(), verbose=False)) / "lock"
    lock.touch()
    try:
        code = "from yaie.ops import kernels; assert kernels.load()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)
