// The quantized matmul for several activation rows on AVX512-VNNI: sixteen weight rows a register.
//
// quant_simd.h's kernel keeps each weight row's 32-value block in its own register, so one
// vpdpbusd is one row's dot product over a block, folded into a float per row with shuffles: a
// dozen instructions for every 4 x 32 multiply-adds, and no fewer when many activation rows share
// the unpacked weights. Here four row groups (16 weight rows) of a block are transposed once into
// eight registers T_0..T_7, T_j holding the 16 rows' values 4j .. 4j+3 in lane order; then for each
// activation row, eight vpdpbusd with its four values 4j .. 4j+3 broadcast (a memory operand) give
// all sixteen dot products, already one per lane: one convert and one or two FMAs finish the
// block. The transposition (two permutes per group, sixteen 128-bit shuffles) is paid once per
// block and shared by every activation row of a tile, so from two rows on this does several
// times less work per multiply-add. Tiles take up to 16 activation rows, sharing each
// transposition with twice the rows of an 8-row tile; the compiler then keeps some of the 16
// accumulators on the stack (in L1), and still the 32-row matmuls ran ~1.2x faster in a
// standalone microbenchmark and batch-32 decoding ~1.15x on average in process
// (benchmarks/results/kv-fp16-tiles16-revisions.txt). The packed layout is quant_common.h's,
// unchanged.
//
// vpdpbusd multiplies unsigned by signed bytes. 4- and 5-bit codes are the unsigned side. For
// signed weights (8-bit values, IQ4_NL's levels) the activations are: x + 128 (its bits XOR 0x80,
// in a copy made once per call, since the unsigned operand cannot be a broadcast from memory), and
// 128 times the block's sum of each weight row (eight more vpdpbusd against ones, per block, not
// per activation row) is taken off the integer dot product, so the result is exact in int32 as
// before. Each output element then takes quant_common.h's one order of float operations, as the
// kernels for fewer rows do, so a row's results do not depend on which kernel took it.

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

namespace yaie_quant {

namespace {

constexpr int64_t kTileGroups = 4;  // 16 weight rows: one int32 lane each in a 512-bit register

// One block's scales (or mins) of four groups, 16 floats in row order; `stride` is one group's.
inline __m512 load16(const float* p, int64_t stride) {
  __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(p));
  v = _mm512_insertf32x4(v, _mm_loadu_ps(p + stride), 1);
  v = _mm512_insertf32x4(v, _mm_loadu_ps(p + 2 * stride), 2);
  return _mm512_insertf32x4(v, _mm_loadu_ps(p + 3 * stride), 3);
}

inline __m512 load16(const uint16_t* p, int64_t stride) {
  int64_t h[4];
  for (int i = 0; i < 4; ++i) std::memcpy(&h[i], p + i * stride, sizeof(int64_t));
  return _mm512_cvtph_ps(_mm256_setr_epi64x(h[0], h[1], h[2], h[3]));
}

// A group's block as two registers of 16 dwords (four values each), first and second. 4- and
// 5-bit codes: the low nibbles hold rows 0 (dwords 0-7) and 2 (8-15), the high ones rows 1 and 3,
// each with its fifth bits where kBits is 5, or its IQ4_NL levels where kLevels; 8-bit: rows 0
// and 1, then rows 2 and 3.
template <int kBits, bool kLevels>
inline void load_group(const uint8_t* p, __m512i& first, __m512i& second) {
  if constexpr (kBits == 8) {
    first = _mm512_loadu_si512(p);
    second = _mm512_loadu_si512(p + 64);
  } else {
    const __m512i nibble = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i v = _mm512_loadu_si512(p);
    first = _mm512_and_si512(v, nibble);
    second = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
    if constexpr (kBits == 5) {  // rows 0 and 2's fifth bits are the first register's mask, 1 and 3's the second's
      uint32_t bits[4];
      std::memcpy(bits, p + 64, sizeof(bits));
      const __m512i fifth = _mm512_set1_epi8(0x10);
      first = _mm512_or_si512(first, _mm512_maskz_mov_epi8(bits[0] | static_cast<uint64_t>(bits[2]) << 32, fifth));
      second = _mm512_or_si512(second, _mm512_maskz_mov_epi8(bits[1] | static_cast<uint64_t>(bits[3]) << 32, fifth));
    }
    if constexpr (kLevels) {
      const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlLevels)));
      first = _mm512_shuffle_epi8(levels, first);
      second = _mm512_shuffle_epi8(levels, second);
    }
  }
}

// The four groups' block transposed: t[j] lane 4 * group + row = that row's values 4j .. 4j+3.
template <int kBits, bool kLevels>
inline void transpose_block(const uint8_t* const p[kTileGroups], __m512i t[8]) {
  // Per group, a permute of its two registers to [rows 0-3 of dword j] in 128-bit lane j: for
  // dwords 0-3 (c) and 4-7 (d). Index 16+ picks from the second register.
  const __m512i pick_c = kBits != 8 ? _mm512_setr_epi32(0, 16, 8, 24, 1, 17, 9, 25, 2, 18, 10, 26, 3, 19, 11, 27)
                                    : _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
  const __m512i pick_d = _mm512_add_epi32(pick_c, _mm512_set1_epi32(4));
  __m512i c[kTileGroups], d[kTileGroups];
  for (int g = 0; g < kTileGroups; ++g) {
    __m512i first, second;
    load_group<kBits, kLevels>(p[g], first, second);
    c[g] = _mm512_permutex2var_epi32(first, pick_c, second);
    d[g] = _mm512_permutex2var_epi32(first, pick_d, second);
  }
  // Then a 4 x 4 transpose of 128-bit lanes: lane g of t[j] is lane j of group g's register.
  for (int half = 0; half < 2; ++half) {
    const __m512i* v = half == 0 ? c : d;
    const __m512i e0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44), e1 = _mm512_shuffle_i64x2(v[2], v[3], 0x44);
    const __m512i e2 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE), e3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
    t[4 * half + 0] = _mm512_shuffle_i64x2(e0, e1, 0x88);
    t[4 * half + 1] = _mm512_shuffle_i64x2(e0, e1, 0xDD);
    t[4 * half + 2] = _mm512_shuffle_i64x2(e2, e3, 0x88);
    t[4 * half + 3] = _mm512_shuffle_i64x2(e2, e3, 0xDD);
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Groups g .. g+3 against activation rows m .. m+kRows-1. With signed weights (8-bit values,
// IQ4_NL's levels) x.q holds the activations + 128.
template <int kBits, bool kLevels, MinTerm kMin, int kRows, typename Scale>
void tile_rows(const PackedWeights& w, const QuantizedRows& x, int64_t g, int64_t m, float* y, int64_t ldy) {
  constexpr int64_t kBytes = block_bytes(kBits);
  constexpr bool kSigned = kBits == 8 || kLevels;
  const int64_t stride = w.blocks * 4;  // one group's scales (and mins)
  const Scale* scales = static_cast<const Scale*>(w.scales) + g * stride;
  const Scale* mins = kMin == kStoredMin ? static_cast<const Scale*>(w.mins) + g * stride : nullptr;
  const uint8_t* p[kTileGroups];
  for (int i = 0; i < kTileGroups; ++i) p[i] = w.qweight + (g + i) * w.blocks * kBytes;

  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block[kTileGroups];
    for (int i = 0; i < kTileGroups; ++i) block[i] = p[i] + b * kBytes;
    __m512i t[8];
    transpose_block<kBits, kLevels>(block, t);
    const __m512 scale = load16(scales + b * 4, stride);
    __m512 min = _mm512_setzero_ps();
    if constexpr (kMin == kStoredMin) min = load16(mins + b * 4, stride);
    if constexpr (kMin == kCentred) min = _mm512_mul_ps(scale, _mm512_set1_ps(-static_cast<float>(1 << (kBits - 1))));
    __m512i offset = _mm512_setzero_si512();  // signed weights: 128 x each weight row's sum over the block
    if constexpr (kSigned) {
      const __m512i ones = _mm512_set1_epi32(0x01010101);
      for (int j = 0; j < 8; ++j) offset = _mm512_dpbusd_epi32(offset, ones, t[j]);
      offset = _mm512_slli_epi32(offset, 7);
    }
    for (int r = 0; r < kRows; ++r) {
      const int64_t xb = (m + r) * x.blocks + b;
      const int8_t* xq = x.q + xb * kBlock;
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        if constexpr (kSigned) {
          dot = _mm512_dpbusd_epi32(dot, broadcast4(xq + 4 * j), t[j]);
        } else {
          dot = _mm512_dpbusd_epi32(dot, t[j], broadcast4(xq + 4 * j));
        }
      }
      if constexpr (kSigned) dot = _mm512_sub_epi32(dot, offset);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(x.d[xb])), acc[r]);
      if constexpr (kMin != kNoMin) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x.s[xb]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(y + (m + r) * ldy + g * kGroupRows, acc[r]);
}

template <int kBits, bool kLevels, MinTerm kMin, typename Scale>
void tile_all_rows(const PackedWeights& w, const QuantizedRows& x, int64_t g, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 16 <= x.rows; m += 16) tile_rows<kBits, kLevels, kMin, 16, Scale>(w, x, g, m, y, ldy);
  if (m + 8 <= x.rows) {
    tile_rows<kBits, kLevels, kMin, 8, Scale>(w, x, g, m, y, ldy);
    m += 8;
  }
  if (m + 4 <= x.rows) {
    tile_rows<kBits, kLevels, kMin, 4, Scale>(w, x, g, m, y, ldy);
    m += 4;
  }
  if (m + 2 <= x.rows) {
    tile_rows<kBits, kLevels, kMin, 2, Scale>(w, x, g, m, y, ldy);
    m += 2;
  }
  if (m < x.rows) tile_rows<kBits, kLevels, kMin, 1, Scale>(w, x, g, m, y, ldy);
}

template <typename Scale>
void tiles(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y, int64_t ldy) {
  const bool stored = w.mins != nullptr;
  for (int64_t g = first; g < last; g += kTileGroups) {
    if (w.bits == 8) {
      if (stored) {
        tile_all_rows<8, false, kStoredMin, Scale>(w, x, g, y, ldy);
      } else {
        tile_all_rows<8, false, kNoMin, Scale>(w, x, g, y, ldy);
      }
    } else if (w.levels) {
      tile_all_rows<4, true, kNoMin, Scale>(w, x, g, y, ldy);
    } else if (w.bits == 5) {
      if (stored) {
        tile_all_rows<5, false, kStoredMin, Scale>(w, x, g, y, ldy);
      } else {
        tile_all_rows<5, false, kCentred, Scale>(w, x, g, y, ldy);
      }
    } else if (stored) {
      tile_all_rows<4, false, kStoredMin, Scale>(w, x, g, y, ldy);
    } else {
      tile_all_rows<4, false, kCentred, Scale>(w, x, g, y, ldy);
    }
  }
}

}  // namespace

int64_t matmul_many_rows_avx512vnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last,
                                    float* y, int64_t ldy) {
  const int64_t end = first + (last - first) / kTileGroups * kTileGroups;
  QuantizedRows rows = x;
  thread_local std::vector<int8_t> shifted;  // signed weights: the activations + 128, per thread
  if ((w.bits == 8 || w.levels) && end > first) {
    const auto size = static_cast<size_t>(x.rows * x.blocks * kBlock);
    if (shifted.size() < size) shifted.resize(size);  // only grows, as quantize_rows' buffer
    for (size_t i = 0; i < size; ++i) shifted[i] = static_cast<int8_t>(x.q[i] ^ 0x80);
    rows.q = shifted.data();
  }
  if (w.half_scales) {
    tiles<uint16_t>(w, rows, first, end, y, ldy);
  } else {
    tiles<float>(w, rows, first, end, y, ldy);
  }
  return end;
}

}  // namespace yaie_quant

#pragma GCC pop_options

#endif
