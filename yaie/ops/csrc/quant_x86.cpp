// The x86 SIMD paths of the quantized matmul: one body (quant_simd.h) compiled for AVX2, AVX-VNNI
// and AVX512-VNNI. Each region carries its own target, so the binary holds every path whatever
// -march says, and quant_matmul.cpp picks one at run time from the CPU's features.

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace yaie_quant::avx2 {
// Without VNNI each block's dot products take maddubs + madd; 4-bit weights can skip most madds.
constexpr bool kSums16 = true;
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  // |u| <= 15 or <= 128 and |s| <= 127 keep maddubs' int16 pair sums from saturating.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#include "quant_simd.h"
}  // namespace yaie_quant::avx2

namespace yaie_quant {

// quantize_row_scalar's arithmetic, eight lanes at a time (the VNNI paths use it too: quantizing
// is a small part of a matmul and has no dot products to speed up). Rounding is the SSE4.1
// round-to-nearest-even, as nearbyint in the default rounding mode; the max ignores NaNs as
// std::max(amax, |x|) does. fast-math is off here as it is for quantize_row_scalar: it rewrote
// 1 / (amax / 127) as 127 / amax, an ulp off, and a value on a rounding tie came out one step
// away from the scalar path's (a test's GPTQ model found one).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void quantize_row_avx2(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) * (1.f / 127.f);
    const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    }
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    // int32 -> int8 packs within 128-bit lanes: 4-byte runs come out as
    // [q0 q1 q2 q3 | q0' ...] by lane; the permute puts the eight runs back in order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    d[b] = scale;
    s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(t4));
  }
}
#pragma GCC pop_options

}  // namespace yaie_quant
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace yaie_quant::avxvnni {
constexpr bool kSums16 = false;  // vpdpbusd already sums in one instruction
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#include "quant_simd.h"
}  // namespace yaie_quant::avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
namespace yaie_quant::avx512vnni {
constexpr bool kSums16 = false;
// The 256-bit form: the kernel is bound by loading weights, not by the width of the dot products.
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#include "quant_simd.h"
}  // namespace yaie_quant::avx512vnni
#pragma GCC pop_options

namespace yaie_quant {

void matmul_avx2(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                 int64_t ldy) {
  avx2::matmul_impl(w, x, first, last, y, ldy);
}

void matmul_avxvnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                    int64_t ldy) {
  avxvnni::matmul_impl(w, x, first, last, y, ldy);
}

void matmul_avx512vnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                       int64_t ldy) {
  // Several rows: sixteen weight rows a register (quant_avx512.cpp) for every whole four groups;
  // the rest here.
  if (x.rows >= 2) first = matmul_many_rows_avx512vnni(w, x, first, last, y, ldy);
  avx512vnni::matmul_impl(w, x, first, last, y, ldy);
}

}  // namespace yaie_quant

#endif
