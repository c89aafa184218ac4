// Matmuls with K-quant weights in their super-block layout (kquant.h): the activation
// quantization, the portable scalar kernel, the row dequantizer (embedding lookups, the
// torch-free reference) and the ops. The SIMD kernels are in kquant_x86.cpp.
//
// A projection may be several packed weights stacked by rows (a fused q/k/v whose v is Q6_K
// beside Q4_K q and k, as llama.cpp's Q4_K_M mixes them): the op takes them as a list, quantizes
// the activation once and writes each part's rows into its slice of one output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kquant.h"
#include "quant_common.h"
#include "quant_matmul.h"

namespace yaie_kquant {

namespace {

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Value n (0..255) of lane i of a record, as the kernels multiply it: the planes' bits put
// together (IQ4_XS: the level its index picks), before any offset.
int32_t value_at(const uint8_t* rec, Type type, int64_t i, int64_t n) {
  const int64_t j = n / 32, r = n % 32, half = r / 16, c = (r % 16) / 4, lane = i * 4 + r % 4;
  int32_t q = 0, bits = 0;
  if (has_4bit(type)) {
    const uint8_t byte = rec[(j * 4 + c) * 64 + lane];
    q = half ? byte >> 4 : byte & 0x0F;
    bits = 4;
  }
  if (has_2bit(type)) {
    q |= ((rec[plane2_offset(type) + (j * 2 + half) * 64 + lane] >> (2 * c)) & 3) << bits;
    bits += 2;
  }
  if (has_1bit(type)) q |= ((rec[plane1_offset(type) + j * 64 + lane] >> (c + 4 * half)) & 1) << bits;
  return type == kIQ4XS ? kIq4Levels[q] : q;
}

// The integer scale and min (or, for the offset types, none) of value n of lane i.
int32_t scale_at(const uint8_t* rec, Type type, int64_t i, int64_t n) {
  const uint8_t byte = rec[scales_offset(type) + (per16(type) ? n / 16 : n / 32) * 16 + i];
  if (type == kQ2K) return byte & 0x0F;
  return type == kQ4K || type == kQ5K ? byte : static_cast<int8_t>(byte);
}

int32_t min_at(const uint8_t* rec, Type type, int64_t i, int64_t n) {
  if (type == kQ2K) return rec[scales_offset(type) + (n / 16) * 16 + i] >> 4;
  return rec[scales_offset(type) + 128 + (n / 32) * 16 + i];
}

}  // namespace

// As quant_matmul.cpp's quantize_row_scalar, per 256 values; fast-math off for the same reason.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void quantize_row_q8k(const float* x, int64_t superblocks, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const float* xs = x + s * kSuper;
    float amax = 0.f;
    for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(xs[i]));
    const float scale = amax * (1.f / 127.f);
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t k = 0; k < kSuper / 16; ++k) {
      int32_t sum = 0;
      for (int64_t i = 16 * k; i < 16 * k + 16; ++i) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xs[i] * inverse)));
        q[s * kSuper + i] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      bsums[s * 16 + k] = static_cast<int16_t>(sum);
    }
    d[s] = scale;
  }
}
#pragma GCC pop_options

void matmul_scalar(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  const Type type = w.type;
  for (int64_t g = first; g < last; ++g) {
    for (int64_t m = 0; m < x.rows; ++m) {
      for (int64_t i = 0; i < kRows; ++i) {
        float acc = 0.f;
        for (int64_t s = 0; s < w.superblocks; ++s) {
          const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
          const int8_t* xq = x.q + m * x.ldq + s * kSuper;
          const int16_t* bsum = x.bsums + (m * x.superblocks + s) * 16;
          const float dx = x.d[m * x.superblocks + s], d = half_at(rec + d_offset(type) + 2 * i);
          // Per run of 16 values (a scale per 32 is the same for its two runs).
          int32_t sumi = 0, summ = 0;
          for (int64_t run = 0; run < 16; ++run) {
            int32_t dot = 0;
            for (int64_t n = 16 * run; n < 16 * run + 16; ++n) dot += value_at(rec, type, i, n) * xq[n];
            const int32_t scale = scale_at(rec, type, i, 16 * run);
            sumi += scale * dot;
            summ += (has_mins(type) ? min_at(rec, type, i, 16 * run) : scale) * bsum[run];
          }
          if (has_mins(type)) {
            const float dmin = half_at(rec + d_offset(type) + 32 + 2 * i);
            acc += dx * (d * static_cast<float>(sumi) - dmin * static_cast<float>(summ));
          } else {
            acc += dx * (d * static_cast<float>(sumi - summ * (1 << offset_shift(type))));
          }
        }
        y[m * ldy + g * kRows + i] = acc;
      }
    }
  }
}

void dequantize_row(const Weights& w, int64_t g, int64_t i, float* out) {
  const Type type = w.type;
  for (int64_t s = 0; s < w.superblocks; ++s) {
    const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
    float* o = out + s * kSuper;
    const float d = half_at(rec + d_offset(type) + 2 * i);
    const float dmin = has_mins(type) ? half_at(rec + d_offset(type) + 32 + 2 * i) : 0.f;
    for (int64_t n = 0; n < kSuper; ++n) {
      // The products in the `gguf` package's order: (d * scale) * q - dmin * min.
      const float scale = d * static_cast<float>(scale_at(rec, type, i, n));
      if (has_mins(type)) {
        const float min = dmin * static_cast<float>(min_at(rec, type, i, n));
        o[n] = scale * static_cast<float>(value_at(rec, type, i, n)) - min;
      } else {
        o[n] = scale * static_cast<float>(value_at(rec, type, i, n) - (1 << offset_shift(type)));
      }
    }
  }
}

namespace {

Weights weights_view(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "a K-quant weight is a contiguous uint8 [groups, K/256, record bytes]");
  const int64_t record = packed.size(2);
  int type = 0;
  while (type < kTypes && kRecordBytes[type] != record) ++type;
  TORCH_CHECK(type < kTypes, "no K-quant type has records of ", record, " bytes");
  return {packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1), static_cast<Type>(type), record};
}

MatmulFn kernel_for(int64_t isa) {
  TORCH_CHECK(yaie_quant::isa_supported(isa), "K-quant matmul: ISA path ", isa, " is not supported by this CPU");
#if defined(__x86_64__) || defined(__i386__)
  // AVX-VNNI machines take the AVX2 kernel: its 256-bit dot products are the same maddubs work.
  if (isa == yaie_quant::kAvx512Amx) return matmul_avx512amx;
  if (isa == yaie_quant::kAvx512Vnni) return matmul_avx512vnni;
  if (isa == yaie_quant::kAvx2 || isa == yaie_quant::kAvxVnni) return matmul_avx2;
#endif
  return matmul_scalar;
}

// One per-thread buffer for the quantized activations, grown to the largest call and reused, as
// quant_matmul.cpp's: q [rows, K] int8, then d [rows, superblocks] float, then bsums int16.
// The rows of q lie K + 64 bytes apart: K is a multiple of 256, so K apart the rows of a tile
// would all fall in the same few L1 sets and evict each other.
Activations quantize(const at::Tensor& x) {
  const int64_t rows = x.size(0), superblocks = x.size(1) / kSuper, ldq = x.size(1) + 64;
  thread_local std::vector<float> buffer;
  // q: ldq bytes a row (ldq / 4 floats); per super-block d (1 float) and 16 int16 sums (8 floats).
  const auto needed = static_cast<size_t>(rows * (ldq / 4 + superblocks * 9));
  if (buffer.size() < needed) buffer.resize(needed);
  int8_t* q = reinterpret_cast<int8_t*>(buffer.data());
  float* d = buffer.data() + rows * ldq / 4;
  int16_t* bsums = reinterpret_cast<int16_t*>(d + rows * superblocks);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / x.size(1)), [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      quantize_row_q8k(xp + m * x.size(1), superblocks, q + m * ldq, d + m * superblocks, bsums + m * superblocks * 16);
    }
  });
  return {q, ldq, d, bsums, rows, superblocks};
}

}  // namespace

at::Tensor matmul(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be a contiguous float32 [M, K]");
  TORCH_CHECK(!parts.empty(), "a K-quant projection needs at least one part");
  std::vector<Weights> weights;
  int64_t rows = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    weights.push_back(weights_view(parts[p]));
    TORCH_CHECK(weights.back().superblocks * kSuper == x.size(1), "x has ", x.size(1), " features, part ", p, " ",
                weights.back().superblocks * kSuper);
    rows += weights.back().groups * kRows;
  }
  TORCH_CHECK(out_features <= rows && out_features > rows - kRows,
              "out_features does not match the parts' rows (every part but the last holds whole groups of 16)");
  const MatmulFn kernel = kernel_for(isa);
  at::Tensor y = at::empty({x.size(0), rows}, x.options());
  if (x.size(0) > 0) {
    const Activations a = quantize(x);
    float* yp = y.data_ptr<float>();
    int64_t offset = 0;
    for (const Weights& w : weights) {
      // A chunk of at least ~64k multiply-adds: below that, waking the pool costs more than it saves.
      const int64_t grain = std::max<int64_t>(1, 65536 / (x.size(0) * x.size(1) * kRows));
      at::parallel_for(0, w.groups, grain, [&](int64_t first, int64_t last) {
        kernel(w, a, first, last, yp + offset, y.size(1));
      });
      offset += w.groups * kRows;
    }
  }
  if (out_features != rows) y = y.narrow(1, 0, out_features).contiguous();
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace yaie_kquant

namespace {

using namespace yaie_kquant;

at::Tensor kquant_matmul(const at::Tensor& x, at::TensorList parts, const std::optional<at::Tensor>& bias,
                         int64_t out_features, int64_t isa) {
  return yaie_kquant::matmul(x, parts.vec(), bias, out_features, isa);
}

// The packed weight as float32 [groups * 16, K]: rows from `first` on, `count` of them (whole
// groups), for the torch-free reference.
at::Tensor kquant_dequantize(const at::Tensor& packed, int64_t first_group, int64_t groups) {
  const Weights w = weights_view(packed);
  TORCH_CHECK(first_group >= 0 && groups >= 0 && first_group + groups <= w.groups, "groups out of range");
  const int64_t k = w.superblocks * kSuper;
  at::Tensor out = at::empty({groups * kRows, k}, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t i = 0; i < kRows; ++i) dequantize_row(w, first_group + g, i, o + (g * kRows + i) * k);
    }
  });
  return out;
}

at::Tensor kquant_embedding(const at::Tensor& packed, const at::Tensor& ids) {
  const Weights w = weights_view(packed);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  const at::Tensor index = ids.contiguous();
  const int64_t tokens = index.size(0), k = w.superblocks * kSuper, rows = w.groups * kRows;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "token id ", id[t], " is outside the table's ", rows, " rows");
  }
  at::Tensor out = at::empty({tokens, k}, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / k), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) dequantize_row(w, id[t] / kRows, id[t] % kRows, o + t * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.def("kquant_matmul(Tensor x, Tensor[] parts, Tensor? bias, int out_features, int isa) -> Tensor");
  m.def("kquant_dequantize(Tensor packed, int first_group, int groups) -> Tensor");
  m.def("kquant_embedding(Tensor packed, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) {
  m.impl("kquant_matmul", &kquant_matmul);
  m.impl("kquant_dequantize", &kquant_dequantize);
  m.impl("kquant_embedding", &kquant_embedding);
}
