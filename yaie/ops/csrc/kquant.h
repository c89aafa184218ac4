// The super-block layout of GGUF's K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS,
// whose super-blocks are alike) and its matmul kernels.
//
// These types keep a 256-value super-block per row with a float16 scale (and min) and small
// integer scales per 32 or 16 values; kept so, a weight costs what its file does (2.6 to 6.6 bits
// a value), where quant_common.h's layouts, with a float16 scale per 32, would cost 4.5 to 8.5 and
// a float multiply per 32 values.
// yaie/ops/kquant_layout.py repacks the file's blocks once at load, without changing a value,
// into records of 16 weight rows by one super-block, each one contiguous read. A record is its
// type's planes of value bits, then its scales, then its float16 factors:
//
//   4-bit plane  2048 bytes (Q4_K, Q5_K, Q6_K, IQ4_XS): the values' low 4 bits. For block j (32
//          values) and chunk c (0..3), 64 bytes: lane i (4 bytes, weight row i of the 16), byte t
//          holds value 32j + 4c + t in its low nibble and value 32j + 16 + 4c + t in its high one.
//          So one AND (or shift and AND) gives 16 rows' four consecutive values per 32-bit lane:
//          a vpdpbusd against four activation bytes broadcast is then 16 rows' dot products at
//          once, with nothing to reduce across lanes.
//   2-bit plane  1024 bytes, per block two runs of 64 (first the values 0-15 of the block, then
//          16-31): lane i byte t, bits 2c and 2c + 1 are two bits of value 32j + 16h + 4c + t (h
//          the run). Q6_K's two high bits (after its 4-bit plane); Q2_K's and Q3_K's two low bits.
//   1-bit plane  512 bytes, per block 64: lane i byte t, bit c is a bit of value 32j + 4c + t,
//          bit 4 + c that of value 32j + 16 + 4c + t. Q5_K's fifth bit, Q3_K's third.
//   scales Q4_K, Q5_K: 8 x 16 bytes of 6-bit scales (block j: the 16 rows'), then 8 x 16 of mins.
//          IQ4_XS: 8 x 16 int8 scales, one per 32 values.
//          Q6_K, Q3_K: 16 x 16 int8 scales, one per 16 values (value 16k .. 16k+15: run k).
//          Q2_K: 16 x 16 bytes, one per 16 values, a 4-bit scale in the low nibble and a 4-bit min
//          in the high one, as its file packs them.
//   d      16 float16: the rows' super-block scales; Q2_K, Q4_K and Q5_K then 16 float16 mins
//          (dmin). Q6_K and IQ4_XS pad their records by 32 bytes to a multiple of 64; Q3_K does
//          not, which keeps it within 1.05x its file's bytes.
//
// w = d * scale_j * q - dmin * min_j (Q2_K, Q4_K, Q5_K: q in 0..3, 0..15 or 0..31),
// w = d * scale_k * (q - offset) (Q6_K: q in 0..63, offset 32; Q3_K: q in 0..7, offset 4;
// IQ4_XS: q = 128 + the level its 4-bit index picks from kIq4Levels, offset 128): exactly the
// `gguf` package's values. Rows past out_features (padding to 16) have zero scales, so zero
// outputs.
//
// Activations are quantized per row in super-blocks of 256, as llama.cpp's Q8_K: a float scale
// d = max|x| / 127 per super-block, q = round-half-even(x / d), and the sum of q per 16 values.
// Everything within a super-block is then integer: the dot products, their scales, the mins'
// and the offsets' terms (a sum of q times a weight-side integer); one float multiply-add per
// super-block and row finishes it. Each output's reduction order is fixed by K alone: the same
// for any number of rows, so the kernels are batch-invariant.

#pragma once

#include <cstdint>

namespace yaie_kquant {

constexpr int64_t kRows = 16;         // weight rows per record
constexpr int64_t kSuper = 256;       // values per super-block

enum Type : int { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ3K = 3, kQ2K = 4, kIQ4XS = 5 };
constexpr int kTypes = 6;

// A record's size in bytes, per type: what identifies the type of a packed tensor.
constexpr int64_t kRecordBytes[kTypes] = {2368, 2880, 3392, 1824, 1344, 2240};

// The planes of value bits a type's record starts with (above).
constexpr bool has_4bit(Type t) { return t == kQ4K || t == kQ5K || t == kQ6K || t == kIQ4XS; }
constexpr bool has_2bit(Type t) { return t == kQ6K || t == kQ3K || t == kQ2K; }
constexpr bool has_1bit(Type t) { return t == kQ5K || t == kQ3K; }
constexpr int64_t plane2_offset(Type t) { return has_4bit(t) ? 2048 : 0; }
constexpr int64_t plane1_offset(Type t) { return plane2_offset(t) + (has_2bit(t) ? 1024 : 0); }
constexpr int64_t scales_offset(Type t) { return plane1_offset(t) + (has_1bit(t) ? 512 : 0); }
// Where the rows' float16 d lie (dmin 32 bytes after, for the types with mins).
constexpr int64_t d_offset(Type t) { return scales_offset(t) + (t == kIQ4XS ? 128 : 256); }

// A scale per 16 values (else per 32); mins (else a fixed offset, 1 << offset_shift).
constexpr bool per16(Type t) { return t == kQ6K || t == kQ3K || t == kQ2K; }
constexpr bool has_mins(Type t) { return t == kQ4K || t == kQ5K || t == kQ2K; }
constexpr int offset_shift(Type t) { return t == kQ6K ? 5 : t == kQ3K ? 2 : 7; }

// IQ4_XS's 16 levels plus its offset 128 (ggml's kvalues_iq4nl + 128), what a 4-bit index picks.
constexpr uint8_t kIq4Levels[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// f.template operator()<T>() for type t: the kernels are templates on the type.
template <typename F>
void with_type(Type t, F&& f) {
  switch (t) {
    case kQ4K:
      return f.template operator()<kQ4K>();
    case kQ5K:
      return f.template operator()<kQ5K>();
    case kQ6K:
      return f.template operator()<kQ6K>();
    case kQ3K:
      return f.template operator()<kQ3K>();
    case kQ2K:
      return f.template operator()<kQ2K>();
    case kIQ4XS:
      return f.template operator()<kIQ4XS>();
  }
}

struct Weights {
  const uint8_t* data;  // [groups, superblocks, record bytes]
  int64_t groups;       // of 16 rows
  int64_t superblocks;  // K / 256
  Type type;
  int64_t record;  // bytes
};

struct Activations {
  const int8_t* q;       // [rows, K], rows ldq bytes apart
  int64_t ldq;           // K plus a cache line: see kquant.cpp's quantize
  const float* d;        // [rows, superblocks]
  const int16_t* bsums;  // [rows, superblocks * 16]: the sum of q per 16 values
  int64_t rows;
  int64_t superblocks;
};

// One row of K values -> int8 super-blocks (see above). Every path computes the same values.
void quantize_row_q8k(const float* x, int64_t superblocks, int8_t* q, float* d, int16_t* bsums);

// y[m, 16g .. 16g+15] for every activation row m and record group g in [first, last).
using MatmulFn = void (*)(const Weights&, const Activations&, int64_t first, int64_t last, float* y, int64_t ldy);

void matmul_scalar(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy);
#if defined(__x86_64__) || defined(__i386__)
void matmul_avx2(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y, int64_t ldy);
void matmul_avx512vnni(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y,
                       int64_t ldy);
// AVX512-VNNI with AMX tile multiplies for each 16 activation rows.
void matmul_avx512amx(const Weights& w, const Activations& x, int64_t first, int64_t last, float* y,
                      int64_t ldy);
#endif

// Row r (0..15) of record group g, all K values as floats, into out.
void dequantize_row(const Weights& w, int64_t g, int64_t r, float* out);

}  // namespace yaie_kquant
