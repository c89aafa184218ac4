// The packed layout of quantized weights and the entry points of each ISA's matmul kernel.
//
// Weights are repacked once at load (yaie/ops/quant_layout.py: pack_weight) into what the kernels stream: rows in
// groups of four, and for each group the 32-value blocks along K, the four rows' blocks next to
// each other, so one group is one contiguous read. Each format keeps its own bits a value:
//
//   4-bit  qweight uint8 [groups, K/32, 64]: two row pairs of 32 bytes; byte i of pair p holds
//          code i of row 2p in its low nibble and code i of row 2p+1 in its high nibble, so
//          one AND and one shift yield two rows' blocks. With mins w = scale * q + min (Q4_1,
//          int4); without, the codes are centred: w = scale * (q - 8) (Q4_0).
//   IQ4_NL qweight int8 [groups, K/32, 64]: 4-bit codes as above, indices into kIq4NlLevels:
//          w = scale * level (int8: the values the codes stand for are signed).
//   5-bit  qweight uint8 [groups, K/32, 80]: the 4-bit layout of the low four bits, then each
//          row's fifth bits in 4 bytes (bit i of row r's little-endian uint32 at byte 64 + 4r is
//          value i's). With mins w = scale * q + min (Q5_1); without w = scale * (q - 16) (Q5_0).
//   8-bit  qweight int8  [groups, K/32, 128]: the four rows' 32 values one after another.
//          w = scale * q (Q8_0, int8), or scale * q + min where narrower codes were widened to
//          share a layer with 8-bit values (yaie/model/quantization.py: fuse).
//   scales [groups, K/32, 4]: one per row and 32-block.
//   mins   [groups, K/32, 4]: where the format has them.
//   Scales and mins are float16 where every one of a weight's values is exactly a float16 (GGUF's
//   types store them so), else float32: at one row the matmul is bound by reading memory, and
//   float16 makes a 4-bit weight 4.5 bits a value instead of 5.
//
// Rows past out_features (the last group's padding) have zero scales and mins.
//
// Activations are quantized per row to int8 in blocks of 32 (llama.cpp's Q8_0 / Q8_1): a scale
// d per block and, for the weights' min term, d * sum(q) per block.
//
// Every kernel computes an output element in one order, whatever the number of activation rows
// and whichever of its loops takes them, so a row's results never depend on its batch: per block
// the exact int32 dot product of the weight's values (codes minus nothing: a centred code's
// offset is a min, -offset * scale) with the activation's, then
//   acc = fma(float(dot), scale * d, acc);  acc = fma(min, s, acc) where there is a min.

#pragma once

#include <cstdint>

namespace yaie_quant {

constexpr int64_t kGroupRows = 4;
constexpr int64_t kBlock = 32;

// IQ4_NL's levels (ggml's kvalues_iq4nl), which its 4-bit codes index.
constexpr int8_t kIq4NlLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Which min a weight's blocks take, as the kernels specialise on it: none, stored, or
// -offset * scale for centred codes (PackedWeights::offset).
enum MinTerm { kNoMin, kStoredMin, kCentred };

// Bytes of one group's block, by bits a value.
constexpr int64_t block_bytes(int bits) { return bits == 4 ? 64 : bits == 5 ? 80 : 128; }

struct PackedWeights {
  const uint8_t* qweight;
  const void* scales;  // float, or float16 bits (uint16_t) when half_scales
  const void* mins;    // as scales; nullptr where the format has none
  int64_t groups;
  int64_t blocks;      // K / 32
  int bits;            // 4, 5 or 8
  bool levels;         // 4-bit codes index kIq4NlLevels (IQ4_NL)
  bool half_scales;

  // The offset of centred codes (Q4_0's 8, Q5_0's 16), 0 for the others.
  int offset() const { return bits != 8 && !levels && mins == nullptr ? 1 << (bits - 1) : 0; }
};

struct QuantizedRows {
  const int8_t* q;     // [rows, blocks * 32]
  const float* d;      // [rows, blocks] scale per block
  const float* s;      // [rows, blocks] d * sum of the block's q
  int64_t rows;
  int64_t blocks;
};

// One activation row -> int8 blocks of 32: d = max|x| / 127, q = round-half-even(x / d) (as
// x * (1 / d)), s = d * sum(q). Every path computes exactly the same values.
using QuantizeRowFn = void (*)(const float* x, int64_t blocks, int8_t* q, float* d, float* s);

void quantize_row_scalar(const float* x, int64_t blocks, int8_t* q, float* d, float* s);
#if defined(__x86_64__) || defined(__i386__)
void quantize_row_avx2(const float* x, int64_t blocks, int8_t* q, float* d, float* s);
#endif

// Kernel paths, lowest first; the value is what the Python side passes as `isa`.
// kAvx512Amx: AVX512-VNNI, and AMX tile multiplies where a kernel has them (the K-quants').
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAvx512Amx = 4 };

// y[m, 4g .. 4g+3] for every activation row m and group g in [first, last); y is [rows, ldy].
using MatmulFn = void (*)(const PackedWeights&, const QuantizedRows&, int64_t first, int64_t last, float* y,
                          int64_t ldy);

void matmul_scalar(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                   int64_t ldy);
#if defined(__x86_64__) || defined(__i386__)
void matmul_avx2(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                 int64_t ldy);
void matmul_avxvnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                    int64_t ldy);
void matmul_avx512vnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last, float* y,
                       int64_t ldy);
// Groups first .. up to last four at a time, for several activation rows and a scale per 32
// values (quant_avx512.cpp); returns where it stopped, the start of what is left (< 4 groups).
int64_t matmul_many_rows_avx512vnni(const PackedWeights& w, const QuantizedRows& x, int64_t first, int64_t last,
                                    float* y, int64_t ldy);
#endif

}  // namespace yaie_quant
