// Matmuls with quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x fp32, W packed as
// quant_common.h describes (GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL, AWQ / GPTQ int4, or
// int8 / int4 quantized at load, packed by yaie/ops/quant_layout.py; the K-quants have their own
// kernels, kquant.cpp).
//
// Each activation row is quantized once to int8 blocks of 32, then every block is an integer dot
// product and one scale FMA (plus one for the min, where there is one), in the ISA path the
// caller names: scalar here, the SIMD ones in quant_x86.cpp and quant_avx512.cpp. Decoding reads
// each weight once per step, so reading 4-8 bits instead of 32 is what makes it fast. Prompts
// and batches take the same kernels, whose per-row arithmetic does not depend on how many rows
// there are (quant_common.h): a row's results are a lone row's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "quant_common.h"
#include "quant_matmul.h"

namespace yaie_quant {

namespace {

// Scale or min number i of a weight, whichever type it is stored in (quant_common.h).
float stored_float(const void* values, int64_t i, bool half) {
  if (half) return static_cast<float>(c10::Half(static_cast<const uint16_t*>(values)[i], c10::Half::from_bits()));
  return static_cast<const float*>(values)[i];
}

// Value i (0..31) of row r (0..3) in a group's block at qw, as the integer the dot product takes:
// the code (a centred code's offset is taken as a min), IQ4_NL's level, or the int8 value.
int32_t value_at(const PackedWeights& w, const uint8_t* qw, int64_t r, int64_t i) {
  if (w.bits == 8) return reinterpret_cast<const int8_t*>(qw)[r * 32 + i];
  int32_t code = (qw[(r / 2) * 32 + i] >> (4 * (r % 2))) & 0x0F;
  if (w.bits == 5) code |= ((qw[64 + 4 * r + i / 8] >> (i % 8)) & 1) << 4;
  return w.levels ? kIq4NlLevels[code] : code;
}

// The min of row r in block wb: stored, -offset * scale for centred codes, else 0.
float min_at(const PackedWeights& w, int64_t wb, int64_t r) {
  if (w.mins != nullptr) return stored_float(w.mins, wb * 4 + r, w.half_scales);
  return static_cast<float>(-w.offset()) * stored_float(w.scales, wb * 4 + r, w.half_scales);
}

}  // namespace

void matmul_scalar(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                   int64_t ldy) {
  const int64_t bytes = block_bytes(w.bits);
  const bool has_min = w.mins != nullptr || w.offset() != 0;
  for (int64_t g = first; g < last; ++g) {
    for (int64_t m = 0; m < x.rows; ++m) {
      for (int64_t r = 0; r < kGroupRows; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < w.blocks; ++b) {
          const int64_t wb = g * w.blocks + b;
          const int64_t xb = m * x.blocks + b;
          const uint8_t* qw = w.qweight + wb * bytes;
          const int8_t* xq = x.q + xb * kBlock;
          int32_t dot = 0;
          for (int64_t i = 0; i < kBlock; ++i) dot += value_at(w, qw, r, i) * xq[i];
          acc = std::fma(static_cast<float>(dot), stored_float(w.scales, wb * 4 + r, w.half_scales) * x.d[xb], acc);
          if (has_min) acc = std::fma(min_at(w, wb, r), x.s[xb], acc);
        }
        y[m * ldy + g * kGroupRows + r] = acc;
      }
    }
  }
}

// Per row and 32-block: d = max|x| / 127, q = round(x / d), s = d * sum(q). fast-math is off
// here: it may rewrite these divisions as reciprocal products, and the tests reproduce the
// rounding exactly in PyTorch (q off by one on a tie would be an error far above fp32 rounding).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void quantize_row_scalar(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax * (1.f / 127.f);
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * inverse)));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}
#pragma GCC pop_options

#if defined(__x86_64__) || defined(__i386__)
namespace {

// AMX's tile state is off for a process until it asks Linux for it (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the CPU's flags alone do not make it usable.
bool amx_usable() {
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile_int8 = (edx >> 24 & 1) && (edx >> 25 & 1);  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile_int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

}  // namespace
#endif

bool isa_supported(int64_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // Every SIMD path is AVX2 code at heart, with FMA and F16C (float16 scales).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  switch (isa) {
    case kScalar:
      return true;
    case kAvx2:
      return avx2;
    case kAvxVnni:
      return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    case kAvx512Amx:
      return isa_supported(kAvx512Vnni) && amx_usable();
    default:
      return false;
  }
#else
  return isa == kScalar;
#endif
}

}  // namespace yaie_quant

namespace {

using namespace yaie_quant;

struct Kernels {
  QuantizeRowFn quantize_row;
  MatmulFn matmul;
};

Kernels kernels_for(int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "quantized matmul: ISA path ", isa, " is not supported by this CPU");
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case kAvx2:
      return {quantize_row_avx2, matmul_avx2};
    case kAvxVnni:
      return {quantize_row_avx2, matmul_avxvnni};
    case kAvx512Vnni:
    case kAvx512Amx:  // these kernels have no AMX path
      return {quantize_row_avx2, matmul_avx512vnni};
    default:
      break;
  }
#endif
  return {quantize_row_scalar, matmul_scalar};
}

// The quantized activations live in one per-thread buffer that grows to the largest call and is
// reused: a one-row matmul is short enough that three tensor allocations a call are measurable.
// It only grows: shrinking it for a narrower matmul would zero-fill it again for the next wider
// one (a layer's down projection after its K=576 ones).
QuantizedRows quantize_rows(const at::Tensor& x, QuantizeRowFn quantize_row) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock;
  thread_local std::vector<float> buffer;
  // q as int8 [rows, blocks * 32] (8 floats' bytes per block), then d and s as floats [rows, blocks].
  const auto needed = static_cast<size_t>(rows * blocks * 10);
  if (buffer.size() < needed) buffer.resize(needed);
  int8_t* q = reinterpret_cast<int8_t*>(buffer.data());
  float* d = buffer.data() + rows * blocks * 8;
  float* s = d + rows * blocks;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / x.size(1)), [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      quantize_row(xp + m * blocks * kBlock, blocks, q + m * blocks * kBlock, d + m * blocks, s + m * blocks);
    }
  });
  return {q, d, s, rows, blocks};
}

PackedWeights packed_view(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous(), "qweight must be a contiguous [groups, K/32, bytes]");
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "scales must be a contiguous float32 or float16 [groups, K/32, 4]");
  TORCH_CHECK(scales.size(0) == qweight.size(0) && scales.size(1) == qweight.size(1),
              "scales and qweight disagree on groups or blocks");
  PackedWeights w{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(), nullptr, qweight.size(0),
                  qweight.size(1), 0, false, scales.scalar_type() == at::kHalf};
  const bool is_signed = qweight.scalar_type() == at::kChar;
  TORCH_CHECK(is_signed || qweight.scalar_type() == at::kByte, "qweight must be uint8 or int8");
  switch (qweight.size(2)) {
    case 64:
      w.bits = 4;
      w.levels = is_signed;
      break;
    case 80:
      TORCH_CHECK(!is_signed, "5-bit codes are uint8");
      w.bits = 5;
      break;
    case 128:
      TORCH_CHECK(is_signed, "8-bit values are int8");
      w.bits = 8;
      break;
    default:
      TORCH_CHECK(false, "qweight must be [groups, K/32, 64, 80 or 128] (4, 5 or 8 bits a value)");
  }
  TORCH_CHECK(scales.size(2) == 4, "weights take one scale per 32 values");
  if (mins.has_value()) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->is_contiguous() && mins->scalar_type() == scales.scalar_type(),
                "mins must be shaped and typed like the scales");
    TORCH_CHECK(!w.levels, "IQ4_NL codes take no mins");
    w.mins = mins->data_ptr();
  }
  return w;
}

at::Tensor finish(at::Tensor y, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(out_features <= y.size(1) && out_features > y.size(1) - kGroupRows,
              "out_features does not match the packed weight's row groups");
  if (out_features != y.size(1)) y = y.narrow(1, 0, out_features).contiguous();
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

namespace yaie_quant {

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be a contiguous float32 [M, K]");
  const PackedWeights w = packed_view(qweight, scales, mins);
  TORCH_CHECK(x.size(1) == w.blocks * kBlock, "x has ", x.size(1), " features, the weight ", w.blocks * kBlock);
  const Kernels kernels = kernels_for(isa);
  at::Tensor y = at::empty({x.size(0), w.groups * kGroupRows}, x.options());
  if (x.size(0) == 0) return finish(y, out_features, bias);  // a step in which no row samples
  const QuantizedRows rows = quantize_rows(x, kernels.quantize_row);
  float* yp = y.data_ptr<float>();
  // A chunk of at least ~64k multiply-adds: below that, waking the pool costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / (x.size(0) * x.size(1) * kGroupRows));
  at::parallel_for(0, w.groups, grain, [&](int64_t first, int64_t last) { kernels.matmul(w, rows, first, last, yp, y.size(1)); });
  return finish(y, out_features, bias);
}

}  // namespace yaie_quant

namespace {

// Row r (0-3) of group g, all its K values as floats, into out.
void dequantize_row(const PackedWeights& w, int64_t g, int64_t r, float* out) {
  const int64_t bytes = block_bytes(w.bits);
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t wb = g * w.blocks + b;
    const uint8_t* qw = w.qweight + wb * bytes;
    float* o = out + b * kBlock;
    const float scale = stored_float(w.scales, wb * 4 + r, w.half_scales);
    const float min = w.mins != nullptr ? stored_float(w.mins, wb * 4 + r, w.half_scales) : 0.f;
    // A centred code is dequantized as the file's scale * (q - offset): exact, as gguf computes it.
    const int offset = w.offset();
    for (int64_t i = 0; i < kBlock; ++i) o[i] = scale * static_cast<float>(value_at(w, qw, r, i) - offset) + min;
  }
}

// Embedding lookup in a quantized table (a tied LM head's weight): only the tokens' rows are
// dequantized, straight from the packed layout, in one call rather than a dozen tensor ops.
at::Tensor quant_embedding(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           const at::Tensor& ids) {
  const PackedWeights w = packed_view(qweight, scales, mins);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  const at::Tensor index = ids.contiguous();
  const int64_t tokens = index.size(0), k = w.blocks * kBlock, rows = w.groups * kGroupRows;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "token id ", id[t], " is outside the table's ", rows, " rows");
  }
  at::Tensor out = at::empty({tokens, k}, qweight.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / k), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) dequantize_row(w, id[t] / kGroupRows, id[t] % kGroupRows, o + t * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.def("quant_isa_supported(int isa) -> bool", &yaie_quant::isa_supported);
  m.def(
      "quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int out_features, int isa) "
      "-> Tensor");
  m.def("quant_embedding(Tensor qweight, Tensor scales, Tensor? mins, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) {
  m.impl("quant_matmul", &yaie_quant::quant_matmul);
  m.impl("quant_embedding", &quant_embedding);
}
