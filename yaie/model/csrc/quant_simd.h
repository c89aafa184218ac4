// The 256-bit SIMD matmul over packed weights (layout: quant_common.h), written once and
// included by quant_x86.cpp once per ISA, inside that ISA's `#pragma GCC target` region and
// namespace; so no include guard. The includer defines, before the include:
//
//   __m256i dot_u8_i8(__m256i u, __m256i s)  // 32 unsigned x 32 signed bytes -> 8 int32 lanes,
//                                            // lane k the sum of products 4k .. 4k+3
//
// which is maddubs + madd on AVX2 and one vpdpbusd with VNNI; everything else is AVX2.

// The four rows' block dot products as 8 int32 lanes: lanes 0-3 the rows' values 0-15, lanes
// 4-7 their values 16-31 (every step stays within its 128-bit half). With per-32 scales both
// halves take the same scale; with per-16 scales (Q6_K) each its own, at no extra cost. The
// rows are summed with unpacks and adds rather than hadd, which costs more than the dot products
// on some x86 cores (AMD's) and no less on the others.
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

// Four or eight scales (or mins) as floats, from float or float16 storage.
static inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
static inline __m128 load4(const uint16_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One group of four weight rows against kRows activation rows starting at m: the weights are
// unpacked once per block and used for every row, the register blocking of the many-row case.
template <int kBits, int kWeightBlock, int kRows, typename Scale>
static inline void group_rows(const PackedWeights& w, const QuantizedRows& x, int64_t g, int64_t m, float* y,
                              int64_t ldy) {
  constexpr int64_t kBytes = kBits == 4 ? 64 : 128;
  constexpr int64_t kScales = kWeightBlock == 32 ? 4 : 8;
  const uint8_t* qw = w.qweight + g * w.blocks * kBytes;
  const Scale* scales = static_cast<const Scale*>(w.scales) + g * w.blocks * kScales;
  const Scale* mins = kBits == 4 ? static_cast<const Scale*>(w.mins) + g * w.blocks * 4 : nullptr;
  const __m256i nibble = _mm256_set1_epi8(0x0F);

  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i wq[4];
    if constexpr (kBits == 4) {
      const __m256i pair01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBytes));
      const __m256i pair23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBytes + 32));
      wq[0] = _mm256_and_si256(pair01, nibble);
      wq[1] = _mm256_and_si256(_mm256_srli_epi16(pair01, 4), nibble);
      wq[2] = _mm256_and_si256(pair23, nibble);
      wq[3] = _mm256_and_si256(_mm256_srli_epi16(pair23, 4), nibble);
    } else {
      for (int r = 0; r < 4; ++r) {
        wq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBytes + 32 * r));
      }
    }
    __m256 scale;
    if constexpr (kWeightBlock == 32) {
      const __m128 four = load4(scales + b * 4);
      scale = _mm256_set_m128(four, four);
    } else {
      scale = load8(scales + b * 8);
    }
    // The min term is added once per row: in the low half only.
    __m256 min = _mm256_setzero_ps();
    if constexpr (kBits == 4) min = _mm256_insertf128_ps(min, load4(mins + b * 4), 0);
    for (int r = 0; r < kRows; ++r) {
      const int64_t xb = (m + r) * x.blocks + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + xb * kBlock));
      const __m256i dots = dot_4rows(wq, xq, kBits == 8);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, _mm256_set1_ps(x.d[xb])), acc[r]);
      if constexpr (kBits == 4) acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(x.s[xb]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    _mm_storeu_ps(y + (m + r) * ldy + g * 4, sum);
  }
}

template <int kBits, int kWeightBlock, typename Scale>
static void groups_all_rows(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                            int64_t ldy) {
  for (int64_t g = first; g < last; ++g) {
    int64_t m = 0;
    for (; m + 4 <= x.rows; m += 4) group_rows<kBits, kWeightBlock, 4, Scale>(w, x, g, m, y, ldy);
    for (; m < x.rows; ++m) group_rows<kBits, kWeightBlock, 1, Scale>(w, x, g, m, y, ldy);
  }
}

template <typename Scale>
static void matmul_scaled(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                          int64_t ldy) {
  if (w.bits == 4) {
    groups_all_rows<4, 32, Scale>(w, x, first, last, y, ldy);
  } else if (w.weight_block == 32) {
    groups_all_rows<8, 32, Scale>(w, x, first, last, y, ldy);
  } else {
    groups_all_rows<8, 16, Scale>(w, x, first, last, y, ldy);
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
