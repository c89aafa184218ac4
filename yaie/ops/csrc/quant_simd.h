// The 256-bit SIMD matmul over packed weights (layout: quant_common.h), written once and
// included by quant_x86.cpp once per ISA, inside that ISA's `#pragma GCC target` region and
// namespace; so no include guard. The includer defines, before the include:
//
//   __m256i dot_u8_i8(__m256i u, __m256i s)  // 32 unsigned x 32 signed bytes -> 8 int32 lanes,
//                                            // lane k the sum of products 4k .. 4k+3
//   constexpr bool kSums16                   // sum 4-bit weights' products in int16 (below)
//
// dot_u8_i8 is maddubs + madd on AVX2 and one vpdpbusd with VNNI; everything else is AVX2.

// The four rows' block dot products as 8 int32 lanes: lanes 0-3 the rows' values 0-15, lanes
// 4-7 their values 16-31 (every step stays within its 128-bit half). Both halves take the same
// scale (or are added first: pair_dots). The rows are summed with unpacks and adds rather than hadd, which costs more than the dot
// products on some x86 cores (AMD's) and no less on the others.
static inline __m256i dot_4rows(const __m256i w[4], __m256i x, bool signed_weights) {
  __m256i d[4];
  for (int r = 0; r < 4; ++r) {
    // maddubs and vpdpbusd multiply unsigned by signed bytes: signed weights move their sign
    // onto the activation (|w| <= 128 and |x| <= 127, so pairs stay within int16).
    d[r] = signed_weights ? dot_u8_i8(_mm256_sign_epi8(w[r], w[r]), _mm256_sign_epi8(x, w[r]))
                          : dot_u8_i8(w[r], x);
  }
  // Per half: [r0 r1 r0 r1] sums of lanes {0,2} and {1,3}, then of all four lanes per row.
  const __m256i d01 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[0], d[1]), _mm256_unpackhi_epi32(d[0], d[1]));
  const __m256i d23 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[2], d[3]), _mm256_unpackhi_epi32(d[2], d[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(d01, d23), _mm256_unpackhi_epi64(d01, d23));
}

// dot_4rows for 4-bit weights without VNNI, summed in int16 before a single widening madd:
// maddubs' pair sums of q (0..15) times x (|x| <= 127) are at most 3,810, so the four added here
// and the two halves pair_dots adds stay below 32,767, and the four-per-row madd of dot_u8_i8
// becomes one per pair of blocks. Lanes: 16-bit pairs in dot_4rows' order.
static inline __m256i sums16_4rows(const __m256i w[4], __m256i x) {
  __m256i p[4];
  for (int r = 0; r < 4; ++r) p[r] = _mm256_maddubs_epi16(w[r], x);
  const __m256i p01 = _mm256_add_epi16(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
  const __m256i p23 = _mm256_add_epi16(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
  return _mm256_add_epi16(_mm256_unpacklo_epi64(p01, p23), _mm256_unpackhi_epi64(p01, p23));
}

// Two consecutive blocks' dot products as 8 int32 lanes, the four rows' sums over block b and
// then over block b + 1, each the sum of dot_4rows' two halves: the layout of the blocks' eight
// scales in memory, so scaling a pair takes one load and one multiply. kSigned: the weights'
// values are signed (8-bit values, IQ4_NL's levels), else unsigned codes of kBits bits.
template <int kBits, bool kSigned>
static inline __m256i pair_dots(const __m256i w0[4], const __m256i w1[4], __m256i x0, __m256i x1) {
  if constexpr (kBits == 4 && !kSigned && kSums16) {
    const __m256i s0 = sums16_4rows(w0, x0), s1 = sums16_4rows(w1, x1);
    const __m256i halves =
        _mm256_add_epi16(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
    return _mm256_madd_epi16(halves, _mm256_set1_epi16(1));
  } else {
    const __m256i d0 = dot_4rows(w0, x0, kSigned), d1 = dot_4rows(w1, x1, kSigned);
    return _mm256_add_epi32(_mm256_permute2x128_si256(d0, d1, 0x20), _mm256_permute2x128_si256(d0, d1, 0x31));
  }
}

// Four or eight scales (or mins) as floats, from float or float16 storage.
static inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
static inline __m128 load4(const uint16_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// p[0] in lanes 0-3, p[1] in lanes 4-7: an activation row's values for a pair of blocks.
static inline __m256 broadcast_pair(const float* p) {
  return _mm256_set_m128(_mm_broadcast_ss(p + 1), _mm_broadcast_ss(p));
}

// 32 bits (bit i of a little-endian uint32 at p) as 32 bytes, 0x10 where the bit is set: a
// 5-bit code's fifth bit in place. Byte i takes byte i / 8 of the word, then its bit i % 8.
static inline __m256i fifth_bits(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(bits), _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// One block of a group (quant_common.h: 64, 80 or 128 bytes) as the four rows' 32 values, one
// register each: codes, IQ4_NL's levels (kLevels) or int8 values.
template <int kBits, bool kLevels>
static inline void unpack_block(const uint8_t* p, __m256i w[4]) {
  if constexpr (kBits == 8) {
    for (int r = 0; r < 4; ++r) w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * r));
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i pair01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i pair23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    w[0] = _mm256_and_si256(pair01, nibble);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(pair01, 4), nibble);
    w[2] = _mm256_and_si256(pair23, nibble);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(pair23, 4), nibble);
    if constexpr (kBits == 5) {
      for (int r = 0; r < 4; ++r) w[r] = _mm256_or_si256(w[r], fifth_bits(p + 64 + 4 * r));
    }
    if constexpr (kLevels) {
      const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlLevels)));
      for (int r = 0; r < 4; ++r) w[r] = _mm256_shuffle_epi8(levels, w[r]);
    }
  }
}

// A block's four (or a pair's eight) mins: stored, or -offset * scale for centred codes.
template <MinTerm kMin, int kBits, typename Scale>
static inline __m128 mins4(const Scale* mins, const Scale* scales) {
  if constexpr (kMin == kStoredMin) return load4(mins);
  return _mm_mul_ps(load4(scales), _mm_set1_ps(-static_cast<float>(1 << (kBits - 1))));
}
template <MinTerm kMin, int kBits, typename Scale>
static inline __m256 mins8(const Scale* mins, const Scale* scales) {
  if constexpr (kMin == kStoredMin) return load8(mins);
  return _mm256_mul_ps(load8(scales), _mm256_set1_ps(-static_cast<float>(1 << (kBits - 1))));
}

static inline __m256i load_block(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// How far ahead 4-bit weights are prefetched at one activation row, in blocks (2 KiB). There the
// 4-bit kernel spends twice the instructions per weight byte the 8-bit one does, so fewer of its
// loads are in flight at once, and it read memory well below the rate the 8-bit one reaches; the
// hint closes part of that gap (a model's matmuls in turn, from memory: ~1.1x). The 8-bit kernel
// was slower with it, and the many-row one, with four rows' work per byte, no faster. Past the
// group it reaches into the next one, which is what the thread reads next.
constexpr int64_t kPrefetchBlocks = 32;

// One group of four weight rows against kRows activation rows starting at m, a block at a time:
// the weights are unpacked once per block and used for every row, the register blocking of the
// many-row case. Per row and block, the order quant_common.h gives: the block's exact int32 dot
// products, one scale FMA, one min FMA.
template <int kBits, bool kLevels, MinTerm kMin, int kRows, typename Scale>
static inline void group_rows(const PackedWeights& w, const QuantizedRows& x, int64_t g, int64_t m, float* y,
                              int64_t ldy) {
  constexpr int64_t kBytes = block_bytes(kBits);
  constexpr bool kSigned = kBits == 8 || kLevels;
  const uint8_t* qw = w.qweight + g * w.blocks * kBytes;
  const Scale* scales = static_cast<const Scale*>(w.scales) + g * w.blocks * 4;
  const Scale* mins = kMin == kStoredMin ? static_cast<const Scale*>(w.mins) + g * w.blocks * 4 : nullptr;

  __m128 acc[kRows];  // the four weight rows' sums
  for (int r = 0; r < kRows; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i wq[4];
    unpack_block<kBits, kLevels>(qw + b * kBytes, wq);
    const __m128 scale = load4(scales + b * 4);
    __m128 min = _mm_setzero_ps();
    if constexpr (kMin != kNoMin) min = mins4<kMin, kBits>(mins + b * 4, scales + b * 4);
    for (int r = 0; r < kRows; ++r) {
      const int64_t xb = (m + r) * x.blocks + b;
      const __m256i d = dot_4rows(wq, load_block(x.q + xb * kBlock), kSigned);
      const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_mul_ps(scale, _mm_set1_ps(x.d[xb])), acc[r]);
      if constexpr (kMin != kNoMin) acc[r] = _mm_fmadd_ps(min, _mm_set1_ps(x.s[xb]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm_storeu_ps(y + (m + r) * ldy + g * 4, acc[r]);
}

// group_rows for one activation row, two blocks at a time: a pair's eight dot products take one
// scale load and multiply (pair_dots), where a block at a time spends as much on its four scales
// as on its products; the pair's two halves are then added to the sums one block after the other,
// as group_rows does. With several rows the scales are shared by all of them, and two blocks'
// unpacked weights would not leave registers for four rows: group_rows keeps that case.
template <int kBits, bool kLevels, MinTerm kMin, typename Scale>
static inline void group_row_pairs(const PackedWeights& w, const QuantizedRows& x, int64_t g, int64_t m, float* y) {
  constexpr int64_t kBytes = block_bytes(kBits);
  constexpr bool kSigned = kBits == 8 || kLevels;
  const uint8_t* qw = w.qweight + g * w.blocks * kBytes;
  const Scale* scales = static_cast<const Scale*>(w.scales) + g * w.blocks * 4;
  const Scale* mins = kMin == kStoredMin ? static_cast<const Scale*>(w.mins) + g * w.blocks * 4 : nullptr;
  const int64_t row = m * x.blocks;

  __m128 acc = _mm_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= w.blocks; b += 2) {
    if constexpr (kBits != 8) {
      _mm_prefetch(reinterpret_cast<const char*>(qw + (b + kPrefetchBlocks) * kBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qw + (b + 1 + kPrefetchBlocks) * kBytes), _MM_HINT_T0);
    }
    __m256i w0[4], w1[4];
    unpack_block<kBits, kLevels>(qw + b * kBytes, w0);
    unpack_block<kBits, kLevels>(qw + (b + 1) * kBytes, w1);
    const int64_t xb = row + b;
    const __m256i dots =
        pair_dots<kBits, kSigned>(w0, w1, load_block(x.q + xb * kBlock), load_block(x.q + (xb + 1) * kBlock));
    const __m256 products = _mm256_cvtepi32_ps(dots);
    const __m256 scale = _mm256_mul_ps(load8(scales + b * 4), broadcast_pair(x.d + xb));
    __m256 min = _mm256_setzero_ps(), sums = _mm256_setzero_ps();
    if constexpr (kMin != kNoMin) {
      min = mins8<kMin, kBits>(mins + b * 4, scales + b * 4);
      sums = broadcast_pair(x.s + xb);
    }
    acc = _mm_fmadd_ps(_mm256_castps256_ps128(products), _mm256_castps256_ps128(scale), acc);
    if constexpr (kMin != kNoMin) acc = _mm_fmadd_ps(_mm256_castps256_ps128(min), _mm256_castps256_ps128(sums), acc);
    acc = _mm_fmadd_ps(_mm256_extractf128_ps(products, 1), _mm256_extractf128_ps(scale, 1), acc);
    if constexpr (kMin != kNoMin) acc = _mm_fmadd_ps(_mm256_extractf128_ps(min, 1), _mm256_extractf128_ps(sums, 1), acc);
  }
  if (b < w.blocks) {  // an odd number of blocks: the last one alone
    __m256i w0[4];
    unpack_block<kBits, kLevels>(qw + b * kBytes, w0);
    const int64_t xb = row + b;
    const __m256i d = dot_4rows(w0, load_block(x.q + xb * kBlock), kSigned);
    const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_mul_ps(load4(scales + b * 4), _mm_set1_ps(x.d[xb])), acc);
    if constexpr (kMin != kNoMin) {
      acc = _mm_fmadd_ps(mins4<kMin, kBits>(mins + b * 4, scales + b * 4), _mm_set1_ps(x.s[xb]), acc);
    }
  }
  _mm_storeu_ps(y + g * 4, acc);
}

template <int kBits, bool kLevels, MinTerm kMin, typename Scale>
static void groups_all_rows(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                            int64_t ldy) {
  for (int64_t g = first; g < last; ++g) {
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group_rows<kBits, kLevels, kMin, 4, Scale>(w, x, g, m, y, ldy);
    for (; m < x.rows; ++m) group_row_pairs<kBits, kLevels, kMin, Scale>(w, x, g, m, y + m * ldy);
  }
}

template <typename Scale>
static void matmul_scaled(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                          int64_t ldy) {
  const bool stored = w.mins != nullptr;
  switch (w.bits) {
    case 4:
      if (w.levels) return groups_all_rows<4, true, kNoMin, Scale>(w, x, first, last, y, ldy);
      if (stored) return groups_all_rows<4, false, kStoredMin, Scale>(w, x, first, last, y, ldy);
      return groups_all_rows<4, false, kCentred, Scale>(w, x, first, last, y, ldy);
    case 5:
      if (stored) return groups_all_rows<5, false, kStoredMin, Scale>(w, x, first, last, y, ldy);
      return groups_all_rows<5, false, kCentred, Scale>(w, x, first, last, y, ldy);
    default:
      if (stored) return groups_all_rows<8, false, kStoredMin, Scale>(w, x, first, last, y, ldy);
      return groups_all_rows<8, false, kNoMin, Scale>(w, x, first, last, y, ldy);
  }
}

static void matmul_impl(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                        int64_t ldy) {
  if (w.half_scales) {
    matmul_scaled<uint16_t>(w, x, first, last, y, ldy);
  } else {
    matmul_scaled<float>(w, x, first, last, y, ldy);
  }
}
