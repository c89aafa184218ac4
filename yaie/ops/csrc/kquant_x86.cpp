// The SIMD kernels of the K-quant matmul (layout and arithmetic: kquant.h): AVX512-VNNI with a
// weight row per 32-bit lane of a 512-bit register, and AVX2 taking a record's 16 rows as two
// halves of eight. Each region carries its own target, so the binary holds both paths whatever
// -march says; kquant.cpp picks one at run time.
//
// Per block of 32 values the record gives, after an AND (and for Q5_K / Q6_K an OR of the high
// bits), eight registers of 16 rows' four consecutive values; each is multiplied with the four
// activation bytes it meets, broadcast, into the rows' dot products, one per lane. The weights
// are unpacked once per block and used for every activation row of a tile (decoding's batch or a
// prompt's tokens), so with more rows a weight byte costs fewer instructions. The integer sums
// of a super-block stay in int32 (kquant.h bounds them); one float multiply-add per super-block
// and row ends it, in the same order for any number of rows.

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>

#include "kquant.h"

namespace yaie_kquant {

namespace {

constexpr int64_t scales_offset(Type t) { return kQsBytes + (t == kQ5K ? 512 : t == kQ6K ? 1024 : 0); }

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A record's worth of cache lines from kPrefetchBytes past its start, asked for as it begins:
// with the hardware prefetcher alone, a decoding step streamed its weights well below the rate
// it does so (a full record or more ahead was slower again, as was spreading the requests over
// the record's blocks).
constexpr int64_t kPrefetchBytes = 1024;

inline void prefetch_ahead(const uint8_t* rec, int64_t record) {
  const char* ahead = reinterpret_cast<const char*>(rec + kPrefetchBytes);
  for (int64_t offset = 0; offset < record; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T0);
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

// Block j of a record as lo[c] (lanes: values 4c .. 4c+3 of the block) and hi[c] (16 + 4c ..).
template <Type T>
inline void unpack512(const uint8_t* rec, int64_t j, __m512i lo[4], __m512i hi[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(rec + (j * 4 + c) * 64);
    lo[c] = _mm512_and_si512(v, nibble);
    hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
  if constexpr (T == kQ5K) {
    // Bit c of each byte to bit 4 for lo, bit 4 + c to bit 4 for hi (16-bit shifts: the masks
    // keep each byte's own bit).
    const __m512i h = _mm512_loadu_si512(rec + kQsBytes + j * 64), bit = _mm512_set1_epi8(0x10);
    lo[0] = _mm512_or_si512(lo[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), bit));
    lo[1] = _mm512_or_si512(lo[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), bit));
    lo[2] = _mm512_or_si512(lo[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), bit));
    lo[3] = _mm512_or_si512(lo[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), bit));
    hi[0] = _mm512_or_si512(hi[0], _mm512_and_si512(h, bit));
    hi[1] = _mm512_or_si512(hi[1], _mm512_and_si512(_mm512_srli_epi16(h, 1), bit));
    hi[2] = _mm512_or_si512(hi[2], _mm512_and_si512(_mm512_srli_epi16(h, 2), bit));
    hi[3] = _mm512_or_si512(hi[3], _mm512_and_si512(_mm512_srli_epi16(h, 3), bit));
  } else if constexpr (T == kQ6K) {
    // Bits 2c, 2c + 1 of each byte to bits 4, 5.
    const __m512i a = _mm512_loadu_si512(rec + kQsBytes + j * 128);
    const __m512i b = _mm512_loadu_si512(rec + kQsBytes + j * 128 + 64), two = _mm512_set1_epi8(0x30);
    lo[0] = _mm512_or_si512(lo[0], _mm512_and_si512(_mm512_slli_epi16(a, 4), two));
    lo[1] = _mm512_or_si512(lo[1], _mm512_and_si512(_mm512_slli_epi16(a, 2), two));
    lo[2] = _mm512_or_si512(lo[2], _mm512_and_si512(a, two));
    lo[3] = _mm512_or_si512(lo[3], _mm512_and_si512(_mm512_srli_epi16(a, 2), two));
    hi[0] = _mm512_or_si512(hi[0], _mm512_and_si512(_mm512_slli_epi16(b, 4), two));
    hi[1] = _mm512_or_si512(hi[1], _mm512_and_si512(_mm512_slli_epi16(b, 2), two));
    hi[2] = _mm512_or_si512(hi[2], _mm512_and_si512(b, two));
    hi[3] = _mm512_or_si512(hi[3], _mm512_and_si512(_mm512_srli_epi16(b, 2), two));
  }
}

inline __m512i scales16(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Record group g against activation rows m .. m + M - 1.
template <Type T, int M>
void group512(const Weights& w, const Activations& x, int64_t g, int64_t m, float* y, int64_t ldy) {
  constexpr int64_t kSc = scales_offset(T);
  // The rows' float sums live in y itself, touched once per super-block: the registers go to
  // the unpacked weights and the rows' integer sums.
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + (m + r) * ldy + g * kRows, _mm512_setzero_ps());
  for (int64_t s = 0; s < w.superblocks; ++s) {
    const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
    prefetch_ahead(rec, w.record);
    __m512i sumi[M];
    for (int r = 0; r < M; ++r) sumi[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 8; ++j) {
      __m512i lo[4], hi[4];
      unpack512<T>(rec, j, lo, hi);
      const __m512i sc_lo = scales16(rec + kSc + (per16(T) ? 32 : 16) * j, per16(T));
      const __m512i sc_hi = per16(T) ? scales16(rec + kSc + 32 * j + 16, true) : sc_lo;
      // Unrolled, so that the rows' sums stay in registers.
#pragma GCC unroll 16
      for (int r = 0; r < M; ++r) {
        const int8_t* xq = x.q + (m + r) * x.ldq + s * kSuper + 32 * j;
        __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          a = _mm512_dpbusd_epi32(a, lo[c], _mm512_set1_epi32(load_i32(xq + 4 * c)));
          b = _mm512_dpbusd_epi32(b, hi[c], _mm512_set1_epi32(load_i32(xq + 16 + 4 * c)));
        }
        if constexpr (per16(T)) {
          sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(a, sc_lo), _mm512_mullo_epi32(b, sc_hi)));
        } else {
          sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(_mm512_add_epi32(a, b), sc_lo));
        }
      }
    }
    // The super-block's second integer term, sum over runs of 16 values of a weight-side factor
    // times the activations' sum over the run: Q6_K's and Q3_K's scales (their offset), Q4_K's and Q5_K's
    // mins (one per two runs). The factors go in int16 pairs, lane i holding row i's factors of
    // runs 2p and 2p + 1, built once for the tile's rows; each row then takes eight vpdpwssd
    // against its run sums, broadcast in pairs as they lie in memory.
    __m512i factors[8];
    for (int p = 0; p < 8; ++p) {
      if constexpr (per16(T)) {
        const __m512i even = scales16(rec + kSc + 32 * p, true), odd = scales16(rec + kSc + 32 * p + 16, true);
        factors[p] = _mm512_or_si512(_mm512_and_si512(even, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(odd, 16));
      } else {
        const __m512i min = scales16(rec + kSc + 128 + 16 * p, false);
        factors[p] = _mm512_or_si512(min, _mm512_slli_epi32(min, 16));
      }
    }
    const __m512 d = halves16(rec + kSc + 256);
    for (int r = 0; r < M; ++r) {
      const int16_t* bsum = x.bsums + ((m + r) * x.superblocks + s) * 16;
      const __m512 dx = _mm512_set1_ps(x.d[(m + r) * x.superblocks + s]);
      __m512i summ = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p) summ = _mm512_dpwssd_epi32(summ, factors[p], _mm512_set1_epi32(load_i32(bsum + 2 * p)));
      if constexpr (per16(T)) {  // the offset (32 or 4) times the sum of scale * the run's sum of q
        const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(summ, offset_shift(T)));
        float* acc = y + (m + r) * ldy + g * kRows;
        _mm512_storeu_ps(acc, _mm512_fmadd_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(total)), _mm512_loadu_ps(acc)));
      } else {
        const __m512 dmin = halves16(rec + kSc + 288);
        const __m512 inner = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(summ)));
        float* acc = y + (m + r) * ldy + g * kRows;
        _mm512_storeu_ps(acc, _mm512_fmadd_ps(dx, inner, _mm512_loadu_ps(acc)));
      }
    }
  }
}

template <Type T>
void groups512(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  for (int64_t g = first; g < last; ++g) {
    int64_t m = 0;
    // Q5_K's unpacking (its fifth bits) is worth sharing among 16 rows; for the others the
    // 16-row tile's spilled sums cost what the sharing saves.
    if constexpr (T == kQ5K) {
      for (; m + 16 <= x.rows; m += 16) group512<T, 16>(w, x, g, m, y, ldy);
    }
    for (; m + 8 <= x.rows; m += 8) group512<T, 8>(w, x, g, m, y, ldy);
    if (m + 4 <= x.rows) {
      group512<T, 4>(w, x, g, m, y, ldy);
      m += 4;
    }
    if (m + 2 <= x.rows) {
      group512<T, 2>(w, x, g, m, y, ldy);
      m += 2;
    }
    if (m < x.rows) group512<T, 1>(w, x, g, m, y, ldy);
  }
}

}  // namespace

void matmul_avx512vnni(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y,
                       int64_t ldy) {
  switch (w.type) {
    case kQ4K:
      return groups512<kQ4K>(w, x, first, last, y, ldy);
    case kQ5K:
      return groups512<kQ5K>(w, x, first, last, y, ldy);
    case kQ6K:
      return groups512<kQ6K>(w, x, first, last, y, ldy);
    case kQ3K:
      return groups512<kQ3K>(w, x, first, last, y, ldy);
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

// Half h (rows 8h .. 8h + 7) of block j, as unpack512 lays out the whole.
template <Type T>
inline void unpack256(const uint8_t* rec, int64_t j, int h, __m256i lo[4], __m256i hi[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (j * 4 + c) * 64 + 32 * h));
    lo[c] = _mm256_and_si256(v, nibble);
    hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  }
  if constexpr (T == kQ5K) {
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kQsBytes + j * 64 + 32 * h));
    const __m256i bit = _mm256_set1_epi8(0x10);
    lo[0] = _mm256_or_si256(lo[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit));
    lo[1] = _mm256_or_si256(lo[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit));
    lo[2] = _mm256_or_si256(lo[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit));
    lo[3] = _mm256_or_si256(lo[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit));
    hi[0] = _mm256_or_si256(hi[0], _mm256_and_si256(hb, bit));
    hi[1] = _mm256_or_si256(hi[1], _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit));
    hi[2] = _mm256_or_si256(hi[2], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bit));
    hi[3] = _mm256_or_si256(hi[3], _mm256_and_si256(_mm256_srli_epi16(hb, 3), bit));
  } else if constexpr (T == kQ6K) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kQsBytes + j * 128 + 32 * h));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kQsBytes + j * 128 + 64 + 32 * h));
    const __m256i two = _mm256_set1_epi8(0x30);
    lo[0] = _mm256_or_si256(lo[0], _mm256_and_si256(_mm256_slli_epi16(a, 4), two));
    lo[1] = _mm256_or_si256(lo[1], _mm256_and_si256(_mm256_slli_epi16(a, 2), two));
    lo[2] = _mm256_or_si256(lo[2], _mm256_and_si256(a, two));
    lo[3] = _mm256_or_si256(lo[3], _mm256_and_si256(_mm256_srli_epi16(a, 2), two));
    hi[0] = _mm256_or_si256(hi[0], _mm256_and_si256(_mm256_slli_epi16(b, 4), two));
    hi[1] = _mm256_or_si256(hi[1], _mm256_and_si256(_mm256_slli_epi16(b, 2), two));
    hi[2] = _mm256_or_si256(hi[2], _mm256_and_si256(b, two));
    hi[3] = _mm256_or_si256(hi[3], _mm256_and_si256(_mm256_srli_epi16(b, 2), two));
  }
}

inline __m256i scales8(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// maddubs' int16 pair sums are at most 2 * 15 * 127 (Q4_K), 2 * 31 * 127 (Q5_K) or 2 * 63 * 127
// (Q6_K): eight, four or two of them add without overflow before one madd widens them.
template <Type T>
inline void dots256(const __m256i lo[4], const __m256i hi[4], const int8_t* xq, __m256i& a, __m256i& b) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[8];
  for (int c = 0; c < 4; ++c) {
    p[c] = _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(load_i32(xq + 4 * c)));
    p[4 + c] = _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(load_i32(xq + 16 + 4 * c)));
  }
  if constexpr (T == kQ4K) {
    const __m256i all = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                         _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
    a = _mm256_madd_epi16(all, ones);
    b = _mm256_setzero_si256();
  } else if constexpr (T == kQ5K || T == kQ3K) {  // Q3_K's sums per 16 values, as its scales
    a = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
    b = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])), ones);
  } else {
    a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                         _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
    b = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), ones),
                         _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), ones));
  }
}

template <Type T, int M>
void group256(const Weights& w, const Activations& x, int64_t g, int64_t m, float* y, int64_t ldy) {
  constexpr int64_t kSc = scales_offset(T);
  __m256 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < w.superblocks; ++s) {
    const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
    prefetch_ahead(rec, w.record);
    __m256i sumi[M][2];
    for (int r = 0; r < M; ++r) sumi[r][0] = sumi[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < 8; ++j) {
      for (int h = 0; h < 2; ++h) {
        __m256i lo[4], hi[4];
        unpack256<T>(rec, j, h, lo, hi);
        const __m256i sc_lo = scales8(rec + kSc + (per16(T) ? 32 : 16) * j + 8 * h, per16(T));
        const __m256i sc_hi = per16(T) ? scales8(rec + kSc + 32 * j + 16 + 8 * h, true) : sc_lo;
#pragma GCC unroll 4
        for (int r = 0; r < M; ++r) {
          __m256i a, b;
          dots256<T>(lo, hi, x.q + (m + r) * x.ldq + s * kSuper + 32 * j, a, b);
          const __m256i scaled = per16(T) ? _mm256_add_epi32(_mm256_mullo_epi32(a, sc_lo), _mm256_mullo_epi32(b, sc_hi))
                                           : _mm256_mullo_epi32(_mm256_add_epi32(a, b), sc_lo);
          sumi[r][h] = _mm256_add_epi32(sumi[r][h], scaled);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      // As group512's factors (int16 pairs of runs 2p and 2p + 1), for this half's eight rows.
      __m256i factors[8];
      for (int p = 0; p < 8; ++p) {
        if constexpr (per16(T)) {
          const __m256i even = scales8(rec + kSc + 32 * p + 8 * h, true);
          const __m256i odd = scales8(rec + kSc + 32 * p + 16 + 8 * h, true);
          factors[p] = _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(odd, 16));
        } else {
          const __m256i min = scales8(rec + kSc + 128 + 16 * p + 8 * h, false);
          factors[p] = _mm256_or_si256(min, _mm256_slli_epi32(min, 16));
        }
      }
      const __m256 d = halves8(rec + kSc + 256 + 16 * h);
      for (int r = 0; r < M; ++r) {
        const int16_t* bsum = x.bsums + ((m + r) * x.superblocks + s) * 16;
        const __m256 dx = _mm256_set1_ps(x.d[(m + r) * x.superblocks + s]);
        __m256i summ = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          summ = _mm256_add_epi32(summ, _mm256_madd_epi16(factors[p], _mm256_set1_epi32(load_i32(bsum + 2 * p))));
        }
        if constexpr (per16(T)) {
          const __m256i total = _mm256_sub_epi32(sumi[r][h], _mm256_slli_epi32(summ, offset_shift(T)));
          acc[r][h] = _mm256_fmadd_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(total)), acc[r][h]);
        } else {
          const __m256 dmin = halves8(rec + kSc + 288 + 16 * h);
          const __m256 inner = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(sumi[r][h]), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(summ)));
          acc[r][h] = _mm256_fmadd_ps(dx, inner, acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m + r) * ldy + g * kRows + 8 * h, acc[r][h]);
  }
}

template <Type T>
void groups256(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  for (int64_t g = first; g < last; ++g) {
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group256<T, 4>(w, x, g, m, y, ldy);
    if (m + 2 <= x.rows) {
      group256<T, 2>(w, x, g, m, y, ldy);
      m += 2;
    }
    if (m < x.rows) group256<T, 1>(w, x, g, m, y, ldy);
  }
}

}  // namespace

void matmul_avx2(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  switch (w.type) {
    case kQ4K:
      return groups256<kQ4K>(w, x, first, last, y, ldy);
    case kQ5K:
      return groups256<kQ5K>(w, x, first, last, y, ldy);
    case kQ6K:
      return groups256<kQ6K>(w, x, first, last, y, ldy);
    case kQ3K:
      return groups256<kQ3K>(w, x, first, last, y, ldy);
  }
}

#pragma GCC pop_options

}  // namespace yaie_kquant

#endif
