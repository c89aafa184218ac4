// The super-block layout of GGUF's K-quant weights (Q4_K, Q5_K, Q6_K) and its matmul kernels.
//
// These types (and Q3_K, in the same frame) keep a 256-value super-block per row with a float16 scale (and min) and small
// integer scales per 32 or 16 values; kept so, a weight costs what its file does (4.5, 5.5 and
// 6.56 bits a value), where quant_common.h's layout, with a float scale per 32, costs 6 to 10.
// yaie/ops/kquant_layout.py repacks the file's blocks once at load, without changing a value,
// into records of 16 weight rows by one super-block, each one contiguous read:
//
//   qs     2048 bytes  the values' low 4 bits. For block j (32 values) and chunk c (0..3), 64
//                      bytes: lane i (4 bytes, weight row i of the 16), byte t holds value
//                      32j + 4c + t in its low nibble and value 32j + 16 + 4c + t in its high one.
//                      So one AND (or shift and AND) gives 16 rows' four consecutive values per
//                      32-bit lane: a vpdpbusd against four activation bytes broadcast is then 16
//                      rows' dot products at once, with nothing to reduce across lanes.
//   qh     Q5_K: 512 bytes, per block 64: lane i byte t, bit c is the high (fifth) bit of value
//                      32j + 4c + t, bit 4 + c that of value 32j + 16 + 4c + t.
//          Q6_K: 1024 bytes, per block two runs of 64 (first the values 0-15 of the block, then
//                      16-31): lane i byte t, bits 2c and 2c + 1 are the two high bits of value
//                      32j + 16h + 4c + t (h the run).
//   scales Q4_K, Q5_K: 8 x 16 bytes of 6-bit scales (block j: the 16 rows'), then 8 x 16 of mins.
//          Q6_K: 16 x 16 int8 scales, one per 16 values (value 16k .. 16k+15: run k).
//   d      16 float16: the rows' super-block scales; Q4_K and Q5_K then 16 float16 mins (dmin).
//          Q6_K pads its record by 32 bytes to a multiple of 64.
//
// w = d * scale_j * q - dmin * min_j (Q4_K, Q5_K: q in 0..15 or 0..31), w = d * scale_k * (q - 32)
// (Q6_K: q in 0..63), w = d * scale * (q - 4) (Q3_K: q in 0..7, scales and d laid out as
// Q6_K's, no high-bit plane; padded to 2432 bytes): exactly the `gguf` package's values. Rows past out_features (padding to 16)
// have zero scales, so zero outputs.
//
// Activations are quantized per row in super-blocks of 256, as llama.cpp's Q8_K: a float scale
// d = max|x| / 127 per super-block, q = round-half-even(x / d), and the sum of q per 16 values.
// Everything within a super-block is then integer: the dot products, their scales, the mins'
// and Q6_K's offset's terms (a sum of q times a weight-side integer); one float multiply-add per
// super-block and row finishes it. Each output's reduction order is fixed by K alone: the same
// for any number of rows, so the kernels are batch-invariant.

#pragma once

#include <cstdint>

namespace yaie_kquant {

constexpr int64_t kRows = 16;         // weight rows per record
constexpr int64_t kSuper = 256;       // values per super-block
constexpr int64_t kQsBytes = 2048;    // the low-4-bit plane of a record

enum Type : int { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ3K = 3 };

// Q6_K and Q3_K: a signed scale per 16 values and a fixed offset (w = d * scale * (q - offset)),
// no mins. Q3_K's values (0..7, the file's 3-bit value + 4) fit the low-4-bit plane alone.
constexpr bool per16(Type t) { return t == kQ6K || t == kQ3K; }
constexpr int offset_shift(Type t) { return t == kQ6K ? 5 : 2; }  // the offset, 32 or 4, as a shift

// A record's size in bytes, per type: what identifies the type of a packed tensor.
constexpr int64_t kRecordBytes[4] = {2368, 2880, 3392, 2432};

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
#endif

// Row r (0..15) of record group g, all K values as floats, into out.
void dequantize_row(const Weights& w, int64_t g, int64_t r, float* out);

}  // namespace yaie_kquant
