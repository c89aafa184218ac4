// The SIMD kernels of the K-quant matmul (layout and arithmetic: kquant.h): AVX512-VNNI with a
// weight row per 32-bit lane of a 512-bit register, and AVX2 taking a record's 16 rows as two
// halves of eight. Each region carries its own target, so the binary holds both paths whatever
// -march says; kquant.cpp picks one at run time.
//
// Per block of 32 values the record gives, after ANDs and shifts of its planes (and for IQ4_XS a
// table lookup), eight registers of 16 rows' four consecutive values; each is multiplied with the four
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

// Bits `from` .. of each byte of v to bits `to` .. (`mask` says which), by a 16-bit shift: the mask
// keeps each byte's own bits, whichever way they moved.
inline __m512i move_bits512(__m512i v, int from, int to, __m512i mask) {
  const __m512i moved = to >= from ? _mm512_slli_epi16(v, to - from) : _mm512_srli_epi16(v, from - to);
  return _mm512_and_si512(moved, mask);
}

// Block j of a record as lo[c] (lanes: values 4c .. 4c+3 of the block) and hi[c] (16 + 4c ..).
template <Type T>
inline void unpack512(const uint8_t* rec, int64_t j, __m512i lo[4], __m512i hi[4]) {
  int bits = 0;  // how many low bits lo and hi hold so far
  if constexpr (has_4bit(T)) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(rec + (j * 4 + c) * 64);
      lo[c] = _mm512_and_si512(v, nibble);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    bits = 4;
  }
  if constexpr (has_2bit(T)) {  // bits 2c, 2c + 1 of each byte to bits `bits`, `bits` + 1
    const __m512i a = _mm512_loadu_si512(rec + plane2_offset(T) + j * 128);
    const __m512i b = _mm512_loadu_si512(rec + plane2_offset(T) + j * 128 + 64);
    const __m512i two = _mm512_set1_epi8(static_cast<char>(3 << bits));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i l = move_bits512(a, 2 * c, bits, two), h = move_bits512(b, 2 * c, bits, two);
      lo[c] = bits ? _mm512_or_si512(lo[c], l) : l;
      hi[c] = bits ? _mm512_or_si512(hi[c], h) : h;
    }
    bits += 2;
  }
  if constexpr (has_1bit(T)) {  // bit c of each byte to bit `bits` for lo, bit 4 + c for hi
    const __m512i v = _mm512_loadu_si512(rec + plane1_offset(T) + j * 64);
    const __m512i one = _mm512_set1_epi8(static_cast<char>(1 << bits));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm512_or_si512(lo[c], move_bits512(v, c, bits, one));
      hi[c] = _mm512_or_si512(hi[c], move_bits512(v, 4 + c, bits, one));
    }
  }
  if constexpr (T == kIQ4XS) {  // the index to its level (plus 128: vpdpbusd takes weights unsigned)
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm512_shuffle_epi8(levels, lo[c]);
      hi[c] = _mm512_shuffle_epi8(levels, hi[c]);
    }
  }
}

inline __m512i scales16(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Block j's integer scales, lane i row i's: of its first 16 values and of its last 16 (the same
// where the type has one per 32).
template <Type T>
inline void block_scales512(const uint8_t* rec, int64_t j, __m512i& sc_lo, __m512i& sc_hi) {
  const uint8_t* sc = rec + scales_offset(T);
  if constexpr (T == kQ2K) {  // the low nibbles
    sc_lo = _mm512_and_si512(scales16(sc + 32 * j, false), _mm512_set1_epi32(0x0F));
    sc_hi = _mm512_and_si512(scales16(sc + 32 * j + 16, false), _mm512_set1_epi32(0x0F));
  } else if constexpr (per16(T)) {
    sc_lo = scales16(sc + 32 * j, true);
    sc_hi = scales16(sc + 32 * j + 16, true);
  } else {
    sc_lo = sc_hi = scales16(sc + 16 * j, T == kIQ4XS);
  }
}

// Runs 2p and 2p + 1's factors of the second integer term (group512), as int16 pairs.
template <Type T>
inline __m512i factor_pair512(const uint8_t* rec, int p) {
  const uint8_t* sc = rec + scales_offset(T);
  __m512i even, odd;
  if constexpr (T == kQ2K) {  // the high nibbles: mins
    even = _mm512_srli_epi32(scales16(sc + 32 * p, false), 4);
    odd = _mm512_srli_epi32(scales16(sc + 32 * p + 16, false), 4);
  } else if constexpr (per16(T)) {
    even = scales16(sc + 32 * p, true);
    odd = scales16(sc + 32 * p + 16, true);
  } else {  // one per 32 values, so the same for both runs: Q4_K's and Q5_K's mins, IQ4_XS's scales
    even = odd = has_mins(T) ? scales16(sc + 128 + 16 * p, false) : scales16(sc + 16 * p, true);
  }
  return _mm512_or_si512(_mm512_and_si512(even, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(odd, 16));
}

// The end of record group g's super-block s for activation rows m .. m + M - 1, given their integer
// dot products scaled per block (sumi): the super-block's second integer term, sum over runs of
// 16 values of a weight-side factor times the activations' sum over the run: the mins (Q2_K's one
// per run, Q4_K's and Q5_K's one per two), or the scales times the offset (Q6_K, Q3_K, IQ4_XS).
// The factors go in int16 pairs, lane i holding row i's factors of runs 2p and 2p + 1, built once
// for the tile's rows; each row then takes eight vpdpwssd against its run sums, broadcast in pairs
// as they lie in memory. Then one float multiply-add per row into y.
template <Type T, int M>
inline void finish512(const uint8_t* rec, const Activations& x, int64_t g, int64_t m, int64_t s, const __m512i sumi[M],
                      float* y, int64_t ldy) {
  __m512i factors[8];
  for (int p = 0; p < 8; ++p) factors[p] = factor_pair512<T>(rec, p);
  const __m512 d = halves16(rec + d_offset(T));
  for (int r = 0; r < M; ++r) {
    const int16_t* bsum = x.bsums + ((m + r) * x.superblocks + s) * 16;
    const __m512 dx = _mm512_set1_ps(x.d[(m + r) * x.superblocks + s]);
    __m512i summ = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) summ = _mm512_dpwssd_epi32(summ, factors[p], _mm512_set1_epi32(load_i32(bsum + 2 * p)));
    float* acc = y + (m + r) * ldy + g * kRows;
    if constexpr (!has_mins(T)) {  // the offset times the sum of scale * the run's sum of q
      const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(summ, offset_shift(T)));
      _mm512_storeu_ps(acc, _mm512_fmadd_ps(dx, _mm512_mul_ps(d, _mm512_cvtepi32_ps(total)), _mm512_loadu_ps(acc)));
    } else {
      const __m512 dmin = halves16(rec + d_offset(T) + 32);
      const __m512 inner = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(summ)));
      _mm512_storeu_ps(acc, _mm512_fmadd_ps(dx, inner, _mm512_loadu_ps(acc)));
    }
  }
}

// Record group g against activation rows m .. m + M - 1.
template <Type T, int M>
void group512(const Weights& w, const Activations& x, int64_t g, int64_t m, float* y, int64_t ldy) {
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
      __m512i sc_lo, sc_hi;
      block_scales512<T>(rec, j, sc_lo, sc_hi);
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
    finish512<T, M>(rec, x, g, m, s, sumi, y, ldy);
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
  with_type(w.type, [&]<Type T>() { groups512<T>(w, x, first, last, y, ldy); });
}

#pragma GCC pop_options

// AMX: from 16 activation rows on, a block's dot products are one tile multiply, TDPBSUD, of the
// activations (A: 16 rows of 32 signed bytes, or two halves of 16 for the types with a scale per
// 16) by the block's unpacked weights (B), which the record's chunks already lay out as AMX's
// B tile wants them (a 64-byte row per four values of K, 16 columns of four bytes: unpack512's
// registers in order): C = 16 activation rows x 16 weight rows of int32. The weights are unpacked
// once per block for the 16 rows, as the AVX-512 path unpacks them once for 8, and each dot product
// is the same exact integer, so a row's result is bit for bit what the AVX-512 path gives it:
// batches split between the paths stay batch-invariant.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A super-block is 8 blocks of 32 values: 8 dot products of K = 32 for the types with a scale per
// 32, 16 of K = 16 for those with one per 16 (each scaled on its own). They go four at a time,
// into C tiles 2-5, with A and B in tiles 0, 1 and 6, 7 by turns: four multiplies in flight, and
// their sums read back only after all four are stored, so no read waits on the store just made.
template <Type T>
void configure_tiles() {
  constexpr int k = per16(T) ? 16 : 32;  // values of K per multiply
  TileConfig config;
  for (int t = 0; t < 8; t += 6) config.rows[t] = 16, config.colsb[t] = k;  // A: 16 activation rows
  for (int t = 1; t < 8; t += 6) config.rows[t] = k / 4, config.colsb[t] = 64;  // B: four values of 16 rows a row
  for (int t = 2; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;  // C: 16 x 16 int32
  _tile_loadconfig(&config);
}

// GCC's tile intrinsics paste the tile's number into the instruction's text: a macro, not a template.
#define YAIE_TILE_DOT(ta, tb, tc, a, lda, b) \
  do {                                      \
    _tile_loadd(ta, a, lda);                \
    _tile_loadd(tb, b, 64);                 \
    _tile_zero(tc);                         \
    _tile_dpbsud(tc, ta, tb);               \
  } while (0)

template <Type T>
void group_amx(const Weights& w, const Activations& x, int64_t g, int64_t m, float* y, int64_t ldy) {
  constexpr int kDots = per16(T) ? 16 : 8, kK = per16(T) ? 16 : 32;
  alignas(64) uint8_t b[8][512];  // block j's weights: values 0-15 (4 rows of 64 bytes), then 16-31
  alignas(64) int32_t c[4][256];
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + (m + r) * ldy + g * kRows, _mm512_setzero_ps());
  for (int64_t s = 0; s < w.superblocks; ++s) {
    const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
    prefetch_ahead(rec, w.record);
    for (int64_t j = 0; j < 8; ++j) {
      __m512i lo[4], hi[4];
      unpack512<T>(rec, j, lo, hi);
      for (int q = 0; q < 4; ++q) {
        _mm512_store_si512(b[j] + 64 * q, lo[q]);
        _mm512_store_si512(b[j] + 256 + 64 * q, hi[q]);
      }
    }
    __m512i sumi[16];
    for (int r = 0; r < 16; ++r) sumi[r] = _mm512_setzero_si512();
    const int8_t* a = x.q + m * x.ldq + s * kSuper;
    for (int first = 0; first < kDots; first += 4) {
      // Dot d covers values kK * d .. of the super-block: block kK * d / 32, at byte kK * d of it.
      YAIE_TILE_DOT(0, 1, 2, a + kK * first, x.ldq, b[0] + kK * first * 16);
      YAIE_TILE_DOT(6, 7, 3, a + kK * (first + 1), x.ldq, b[0] + kK * (first + 1) * 16);
      YAIE_TILE_DOT(0, 1, 4, a + kK * (first + 2), x.ldq, b[0] + kK * (first + 2) * 16);
      YAIE_TILE_DOT(6, 7, 5, a + kK * (first + 3), x.ldq, b[0] + kK * (first + 3) * 16);
      _tile_stored(2, c[0], 64);
      _tile_stored(3, c[1], 64);
      _tile_stored(4, c[2], 64);
      _tile_stored(5, c[3], 64);
      __m512i sc[4];
      for (int d = 0; d < 4; d += 2) {
        // A block's two halves (per 16), or two blocks (per 32).
        __m512i lo, hi;
        block_scales512<T>(rec, per16(T) ? (first + d) / 2 : first + d, lo, hi);
        if constexpr (per16(T)) {
          sc[d] = lo, sc[d + 1] = hi;
        } else {
          __m512i next;
          block_scales512<T>(rec, first + d + 1, next, hi);
          sc[d] = lo, sc[d + 1] = next;
        }
      }
      for (int r = 0; r < 16; ++r) {
        const __m512i p0 = _mm512_mullo_epi32(_mm512_load_si512(c[0] + 16 * r), sc[0]);
        const __m512i p1 = _mm512_mullo_epi32(_mm512_load_si512(c[1] + 16 * r), sc[1]);
        const __m512i p2 = _mm512_mullo_epi32(_mm512_load_si512(c[2] + 16 * r), sc[2]);
        const __m512i p3 = _mm512_mullo_epi32(_mm512_load_si512(c[3] + 16 * r), sc[3]);
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_add_epi32(p0, p1), _mm512_add_epi32(p2, p3)));
      }
    }
    finish512<T, 16>(rec, x, g, m, s, sumi, y, ldy);
  }
}

#undef YAIE_TILE_DOT

template <Type T>
void groups_amx(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  if (x.rows < 16) return groups512<T>(w, x, first, last, y, ldy);
  configure_tiles<T>();
  for (int64_t g = first; g < last; ++g) {
    int64_t m = 0;
    for (; m + 16 <= x.rows; m += 16) group_amx<T>(w, x, g, m, y, ldy);
    // The rows left, as the AVX-512 path takes them.
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
  _tile_release();
}

}  // namespace

void matmul_avx512amx(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  with_type(w.type, [&]<Type T>() { groups_amx<T>(w, x, first, last, y, ldy); });
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

inline __m256i move_bits256(__m256i v, int from, int to, __m256i mask) {
  const __m256i moved = to >= from ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
  return _mm256_and_si256(moved, mask);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Half h (rows 8h .. 8h + 7) of block j, as unpack512 lays out the whole; IQ4_XS's levels signed
// (dots256 says why).
template <Type T>
inline void unpack256(const uint8_t* rec, int64_t j, int h, __m256i lo[4], __m256i hi[4]) {
  int bits = 0;
  if constexpr (has_4bit(T)) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load256(rec + (j * 4 + c) * 64 + 32 * h);
      lo[c] = _mm256_and_si256(v, nibble);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    bits = 4;
  }
  if constexpr (has_2bit(T)) {
    const __m256i a = load256(rec + plane2_offset(T) + j * 128 + 32 * h);
    const __m256i b = load256(rec + plane2_offset(T) + j * 128 + 64 + 32 * h);
    const __m256i two = _mm256_set1_epi8(static_cast<char>(3 << bits));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i l = move_bits256(a, 2 * c, bits, two), u = move_bits256(b, 2 * c, bits, two);
      lo[c] = bits ? _mm256_or_si256(lo[c], l) : l;
      hi[c] = bits ? _mm256_or_si256(hi[c], u) : u;
    }
    bits += 2;
  }
  if constexpr (has_1bit(T)) {
    const __m256i v = load256(rec + plane1_offset(T) + j * 64 + 32 * h);
    const __m256i one = _mm256_set1_epi8(static_cast<char>(1 << bits));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm256_or_si256(lo[c], move_bits256(v, c, bits, one));
      hi[c] = _mm256_or_si256(hi[c], move_bits256(v, 4 + c, bits, one));
    }
  }
  if constexpr (T == kIQ4XS) {
    const __m256i levels = _mm256_sub_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels))), _mm256_set1_epi8(-128));
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm256_shuffle_epi8(levels, lo[c]);
      hi[c] = _mm256_shuffle_epi8(levels, hi[c]);
    }
  }
}

inline __m256i scales8(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// maddubs multiplies unsigned by signed bytes into int16 pair sums, saturating: at most
// 2 * 15 * 127 (Q4_K), 2 * 31 * 127 (Q5_K), 2 * 63 * 127 (Q6_K), less for Q2_K and Q3_K, so
// eight, four or two of them add without overflow before one madd widens them. IQ4_XS's levels
// plus 128 would overflow a pair: its levels stay signed, and each takes the sign of the
// activation it meets, which gives up its own (|x| * sign(x) * w), within 2 * 127 * 127.
template <Type T>
inline void dots256(const __m256i lo[4], const __m256i hi[4], const int8_t* xq, __m256i& a, __m256i& b) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[8];
  for (int c = 0; c < 4; ++c) {
    const __m256i xl = _mm256_set1_epi32(load_i32(xq + 4 * c)), xh = _mm256_set1_epi32(load_i32(xq + 16 + 4 * c));
    if constexpr (T == kIQ4XS) {
      p[c] = _mm256_maddubs_epi16(_mm256_abs_epi8(xl), _mm256_sign_epi8(lo[c], xl));
      p[4 + c] = _mm256_maddubs_epi16(_mm256_abs_epi8(xh), _mm256_sign_epi8(hi[c], xh));
    } else {
      p[c] = _mm256_maddubs_epi16(lo[c], xl);
      p[4 + c] = _mm256_maddubs_epi16(hi[c], xh);
    }
  }
  if constexpr (T == kQ4K) {
    const __m256i all = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                         _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
    a = _mm256_madd_epi16(all, ones);
    b = _mm256_setzero_si256();
  } else if constexpr (T == kQ5K || T == kQ3K || T == kQ2K) {  // Q3_K's and Q2_K's sums per 16, as their scales
    a = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
    b = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])), ones);
  } else if constexpr (T == kQ6K) {
    a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                         _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
    b = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), ones),
                         _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), ones));
  } else {
    a = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                         _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
    b = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[4], ones), _mm256_madd_epi16(p[5], ones)),
                         _mm256_add_epi32(_mm256_madd_epi16(p[6], ones), _mm256_madd_epi16(p[7], ones)));
  }
}

// As block_scales512, for half h's eight rows.
template <Type T>
inline void block_scales256(const uint8_t* rec, int64_t j, int h, __m256i& sc_lo, __m256i& sc_hi) {
  const uint8_t* sc = rec + scales_offset(T) + 8 * h;
  if constexpr (T == kQ2K) {
    sc_lo = _mm256_and_si256(scales8(sc + 32 * j, false), _mm256_set1_epi32(0x0F));
    sc_hi = _mm256_and_si256(scales8(sc + 32 * j + 16, false), _mm256_set1_epi32(0x0F));
  } else if constexpr (per16(T)) {
    sc_lo = scales8(sc + 32 * j, true);
    sc_hi = scales8(sc + 32 * j + 16, true);
  } else {
    sc_lo = sc_hi = scales8(sc + 16 * j, T == kIQ4XS);
  }
}

// As factor_pair512, for half h's eight rows.
template <Type T>
inline __m256i factor_pair256(const uint8_t* rec, int p, int h) {
  const uint8_t* sc = rec + scales_offset(T) + 8 * h;
  __m256i even, odd;
  if constexpr (T == kQ2K) {
    even = _mm256_srli_epi32(scales8(sc + 32 * p, false), 4);
    odd = _mm256_srli_epi32(scales8(sc + 32 * p + 16, false), 4);
  } else if constexpr (per16(T)) {
    even = scales8(sc + 32 * p, true);
    odd = scales8(sc + 32 * p + 16, true);
  } else {
    even = odd = scales8(sc + 128 + 16 * p, false);  // mins (IQ4_XS has no second term here)
  }
  return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(odd, 16));
}

template <Type T, int M>
void group256(const Weights& w, const Activations& x, int64_t g, int64_t m, float* y, int64_t ldy) {
  __m256 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < w.superblocks; ++s) {
    const uint8_t* rec = w.data + (g * w.superblocks + s) * w.record;
    prefetch_ahead(rec, w.record);
    __m256i sumi[M][2];
    for (int r = 0; r < M; ++r) sumi[r][0] = sumi[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < 8; ++j) {
      for (int h = 0; h < 2; ++h) {
        __m256i lo[4], hi[4], sc_lo, sc_hi;
        unpack256<T>(rec, j, h, lo, hi);
        block_scales256<T>(rec, j, h, sc_lo, sc_hi);
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
      const __m256 d = halves8(rec + d_offset(T) + 16 * h);
      if constexpr (T == kIQ4XS) {  // signed levels: no offset, so no second term
        for (int r = 0; r < M; ++r) {
          const __m256 dx = _mm256_set1_ps(x.d[(m + r) * x.superblocks + s]);
          acc[r][h] = _mm256_fmadd_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sumi[r][h])), acc[r][h]);
        }
        continue;
      }
      __m256i factors[8];
      for (int p = 0; p < 8; ++p) factors[p] = factor_pair256<T>(rec, p, h);
      for (int r = 0; r < M; ++r) {
        const int16_t* bsum = x.bsums + ((m + r) * x.superblocks + s) * 16;
        const __m256 dx = _mm256_set1_ps(x.d[(m + r) * x.superblocks + s]);
        __m256i summ = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          summ = _mm256_add_epi32(summ, _mm256_madd_epi16(factors[p], _mm256_set1_epi32(load_i32(bsum + 2 * p))));
        }
        if constexpr (!has_mins(T)) {
          const __m256i total = _mm256_sub_epi32(sumi[r][h], _mm256_slli_epi32(summ, offset_shift(T)));
          acc[r][h] = _mm256_fmadd_ps(dx, _mm256_mul_ps(d, _mm256_cvtepi32_ps(total)), acc[r][h]);
        } else {
          const __m256 dmin = halves8(rec + d_offset(T) + 32 + 16 * h);
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
  with_type(w.type, [&]<Type T>() { groups256<T>(w, x, first, last, y, ldy); });
}

#pragma GCC pop_options

}  // namespace yaie_kquant

#endif
