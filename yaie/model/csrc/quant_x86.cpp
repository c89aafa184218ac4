// The x86 SIMD paths of the quantized matmul: one body (quant_simd.h) compiled for AVX2, AVX-VNNI
// and AVX512-VNNI. Each region carries its own target, so the binary holds every path whatever
// -march says, and quant_matmul.cpp picks one at run time from the CPU's features.

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace yaie_quant::avx2 {
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  // |u| <= 15 or <= 128 and |s| <= 127 keep maddubs' int16 pair sums from saturating.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#include "quant_simd.h"
}  // namespace yaie_quant::avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace yaie_quant::avxvnni {
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#include "quant_simd.h"
}  // namespace yaie_quant::avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512vnni")
namespace yaie_quant::avx512vnni {
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
  avx512vnni::matmul_impl(w, x, first, last, y, ldy);
}

}  // namespace yaie_quant

#endif
