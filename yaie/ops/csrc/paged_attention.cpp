// Decode attention over the paged KV cache, for CPUs: one new query token per sequence, keys and
// values read where they lie in their blocks.
//
// The PyTorch path (attention.py) first copies every sequence's blocks into a dense tensor and
// then runs scaled_dot_product_attention on it: two passes over the context plus op overheads,
// which grows with the context length. Here each (sequence, KV head, stretch of the context) is
// one work item that walks the block table directly:
//
//   context of one sequence:  | split 0 (~64 tokens, whole blocks) | split 1 | ... | split n-1 |
//   each split, for every query head h (GQA: h reads KV head h / group):
//     pass 1  s[h][t] = scale * q_h . k_t                     (reads the split's K blocks once)
//     pass 2  p = exp(s - max_t s);  acc[h] = sum_t p[t] v_t  (reads its V blocks once; with
//             AVX2 and an fp32 cache, once per query head, each head's sum kept in registers)
//   (with AVX-512 and 64-value heads: both passes per KV head, for all the query heads that read
//   it at once, 16-bit caches widened in registers; see scores_avx512)
//   then the splits of a sequence are merged with their maxima and sums (the "flash-decoding"
//   combine), so one sequence still keeps every thread busy: with splits this short, from a
//   context of 65 tokens on (one client decoding a chat answer), which made its 30 layers
//   ~6% faster than 256-token splits at contexts of 120-250 and no slower at 60 or 500 (A/B in
//   one process). A split's length depends on nothing but the constant, so a sequence's result
//   does not depend on the batch it runs in.
//
// The cache may be fp32, bf16 or fp16, independently of q's dtype (--kv-cache-dtype): a 16-bit
// cache row is widened to fp32 once as it is read, and all the maths is fp32. An fp32 cache is
// read in place, with no copy.
//
// Built by yaie/ops/kernels.py with -O3 -march=native -ffast-math. Fast-math lets GCC vectorize
// expf through glibc's vector math library; it is safe here because the kernel never produces
// infinities or NaNs: it only visits real context tokens (no -inf masking), and every
// exponent is s - max <= 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kSplitTokens = 64;  // about this many context tokens per work item

// q . k over one head. With AVX2 the sum is split over four accumulators: a single one makes the
// 64-value dot one chain of dependent FMAs, whose latency, not the arithmetic, sets its speed.
inline float dot(const float* a, const float* b, int64_t n) {
  float out = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) {
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
    }
  }
  for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
  const __m256 sum8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
  sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  out = _mm_cvtss_f32(_mm_add_ss(sum4, _mm_movehdup_ps(sum4)));
  for (; i < n; ++i) out += a[i] * b[i];
#else
#pragma omp simd reduction(+ : out)
  for (int64_t i = 0; i < n; ++i) out += a[i] * b[i];
#endif
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[0, 8 * kVecs) = sum over the tokens begin..end-1 of p[t - begin] * (that token's V row of
// one KV head), from an fp32 cache. The whole sum stays in registers while the tokens stream by;
// the portable loop (attend_split) loads, adds to and stores the output at every token.
template <int kVecs>
void weighted_sum_avx2(const float* v_cache, const int64_t* block_table, int64_t begin, int64_t end,
                       int64_t block_size, int64_t token_stride, const float* p, float* out) {
  __m256 acc[kVecs];
  for (int j = 0; j < kVecs; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = begin; t < end;) {
    const int64_t offset = t % block_size, count = std::min(block_size - offset, end - t);
    const float* row = v_cache + (block_table[t / block_size] * block_size + offset) * token_stride;
    for (int64_t j = 0; j < count; ++j, row += token_stride) {
      const __m256 weight = _mm256_set1_ps(p[t - begin + j]);
      for (int v = 0; v < kVecs; ++v) acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * v), acc[v]);
    }
    t += count;
  }
  for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#endif

#if defined(__AVX512F__)
// Sixteen cache values as fp32: a 16-bit row is widened in registers (bf16 by a shift).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A cache (fp32, bf16 or fp16) with 64-value heads on AVX-512, the G (<= 4) query heads that
// read one KV head at a time: a head's row is four registers, so the G query rows stay in
// registers for the whole split, and a token's row (K, then V) is loaded once for all G heads,
// where the loops above take one head at a time and reload. For K, each token's G dot products
// share one horizontal reduction (hadd of four vectors at once); for V, the G weighted sums are
// 4 x G accumulators. scores [G, n] (stride n) for the tokens begin..end-1; q [G, 64], scaled.
template <int G, typename C>
void scores_avx512(const float* q, const C* k_cache, int64_t kv, const int64_t* block_table, int64_t begin,
                   int64_t end, int64_t block_size, int64_t token_stride, float* scores, int64_t n) {
  const C* k_head = k_cache + kv * 64;
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 4; ++j) qv[g][j] = _mm512_loadu_ps(q + g * 64 + 16 * j);
  }
  for (int64_t t = begin; t < end;) {
    const int64_t offset = t % block_size, count = std::min(block_size - offset, end - t);
    const C* row = k_head + (block_table[t / block_size] * block_size + offset) * token_stride;
    for (int64_t j = 0; j < count; ++j, row += token_stride) {
      const __m512 k0 = load16(row), k1 = load16(row + 16), k2 = load16(row + 32), k3 = load16(row + 48);
      __m256 half[4];
      for (int g = 0; g < 4; ++g) {
        if (g >= G) {
          half[g] = _mm256_setzero_ps();
          continue;
        }
        __m512 p = _mm512_mul_ps(qv[g][0], k0);
        p = _mm512_fmadd_ps(qv[g][1], k1, p);
        p = _mm512_fmadd_ps(qv[g][2], k2, p);
        p = _mm512_fmadd_ps(qv[g][3], k3, p);
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
        half[g] = _mm256_add_ps(_mm512_castps512_ps256(p), high);
      }
      // [g0 g1 g2 g3] sums of lanes 0-3 in the low 128 bits, of lanes 4-7 in the high ones.
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
      float sums[4];
      _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      const int64_t i = t - begin + j;
      for (int g = 0; g < G; ++g) scores[g * n + i] = sums[g];
    }
    t += count;
  }
}

// out [G, 64] = for each of the G heads, the sum over the tokens of p[g * n + i] * v_i.
template <int G, typename C>
void weighted_sums_avx512(const C* v_cache, int64_t kv, const int64_t* block_table, int64_t begin, int64_t end,
                          int64_t block_size, int64_t token_stride, const float* p, int64_t n, float* out) {
  const C* v_head = v_cache + kv * 64;
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  }
  for (int64_t t = begin; t < end;) {
    const int64_t offset = t % block_size, count = std::min(block_size - offset, end - t);
    const C* row = v_head + (block_table[t / block_size] * block_size + offset) * token_stride;
    for (int64_t j = 0; j < count; ++j, row += token_stride) {
      const __m512 v[4] = {load16(row), load16(row + 16), load16(row + 32), load16(row + 48)};
      const int64_t i = t - begin + j;
      for (int g = 0; g < G; ++g) {
        const __m512 weight = _mm512_set1_ps(p[g * n + i]);
        for (int d = 0; d < 4; ++d) acc[g][d] = _mm512_fmadd_ps(weight, v[d], acc[g][d]);
      }
    }
    t += count;
  }
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + g * 64 + 16 * j, acc[g][j]);
  }
}
#endif

struct Shapes {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t blocks_per_split, num_splits;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// A cache row of n values as fp32: an fp32 row is itself; others are widened into buf.
template <typename C>
const float* widen(const C* row, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(row[i]);
  return buf;
}

inline const float* widen(const float* row, int64_t, float*) { return row; }

inline const float* widen(const c10::BFloat16* row, int64_t n, float* buf) {
  // bf16 is the top half of an fp32: a shift, which the compiler vectorizes.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(buf + i, &word, sizeof(float));
  }
  return buf;
}

inline const float* widen(const c10::Half* row, int64_t n, float* buf) {
  int64_t i = 0;
#if defined(__F16C__)
  // c10::Half converts one value at a time; F16C's vcvtph2ps does eight.
  for (; i + 8 <= n; i += 8) {
    const __m128i half8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(half8));
  }
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(row[i]);
  return buf;
}

// One split of one sequence, all heads: writes the unnormalised output of every query head to
// acc [heads, head_dim], and each head's score maximum and exp-sum to max_out / sum_out [heads].
// Blocks are read whole and in order (a block holds every KV head of its tokens), K once, V once
// (or per query head: see pass 2 above).
// Q is q's element type, C the cache's.
template <typename Q, typename C>
void attend_split(const Q* q, const C* k_cache, const C* v_cache, const int64_t* block_table,
                  int64_t begin, int64_t end, float scale, const Shapes& s, float* acc,
                  float* max_out, float* sum_out) {
  const int64_t H = s.num_heads, G = s.group(), D = s.head_dim, n = end - begin;
  const int64_t token_stride = s.num_kv_heads * D;  // one token's row: [kv_heads, dim]
  // Per thread and reused: a work item is short enough that allocating these showed. They only
  // grow: resizing `scores` down for a short sequence would zero-fill it again for the next,
  // longer one (the sequences of a batch differ in length).
  thread_local std::vector<float> qf, scores, row_buf;
  const auto grow = [](std::vector<float>& v, int64_t size) {
    if (v.size() < static_cast<size_t>(size)) v.resize(static_cast<size_t>(size));
  };
  grow(qf, H * D);
  grow(scores, H * n);
  if constexpr (!std::is_same_v<C, float>) grow(row_buf, token_stride);
  for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;

  const auto softmax = [&](int64_t first_head, int64_t last_head) {  // scores -> exp(s - max), per head
    for (int64_t h = first_head; h < last_head; ++h) {
      float* sh = scores.data() + h * n;
      float m = -FLT_MAX;
      for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sh[i] = std::exp(sh[i] - m);
        sum += sh[i];
      }
      max_out[h] = m;
      sum_out[h] = sum;
    }
  };

#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half>) {
    if (D == 64 && G <= 4) {
      for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
        const auto attend = [&](auto group) {
          constexpr int kG = decltype(group)::value;
          scores_avx512<kG, C>(qf.data() + kv * G * D, k_cache, kv, block_table, begin, end, s.block_size, token_stride,
                            scores.data() + kv * G * n, n);
          softmax(kv * G, (kv + 1) * G);
          weighted_sums_avx512<kG, C>(v_cache, kv, block_table, begin, end, s.block_size, token_stride,
                                   scores.data() + kv * G * n, n, acc + kv * G * D);
        };
        switch (G) {
          case 1: attend(std::integral_constant<int, 1>()); break;
          case 2: attend(std::integral_constant<int, 2>()); break;
          case 3: attend(std::integral_constant<int, 3>()); break;
          default: attend(std::integral_constant<int, 4>());
        }
      }
      return;
    }
  }
#endif

  // Calls visit(i, row) for the tokens begin..end-1, one block at a time, with each token's row
  // as fp32; i counts from 0.
  auto for_each_token = [&](const C* cache, auto&& visit) {
    for (int64_t t = begin; t < end;) {
      const int64_t offset = t % s.block_size, count = std::min(s.block_size - offset, end - t);
      const C* row = cache + (block_table[t / s.block_size] * s.block_size + offset) * token_stride;
      for (int64_t j = 0; j < count; ++j, row += token_stride) {
        visit(t - begin + j, widen(row, token_stride, row_buf.data()));
      }
      t += count;
    }
  };

  for_each_token(k_cache, [&](int64_t i, const float* k_row) {
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      const float* k = k_row + kv * D;
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h) {
        const float* qh = qf.data() + h * D;
        scores[h * n + i] = dot(qh, k, D);
      }
    }
  });

  softmax(0, H);

#if defined(__AVX2__) && defined(__FMA__)
  // An fp32 cache with the common head sizes: each head's weighted sum of V rows in registers.
  if constexpr (std::is_same_v<C, float>) {
    if (D == 64 || D == 128) {
      for (int64_t h = 0; h < H; ++h) {
        const float* v_head = v_cache + (h / G) * D;
        const float* p = scores.data() + h * n;
        if (D == 64) {
          weighted_sum_avx2<8>(v_head, block_table, begin, end, s.block_size, token_stride, p, acc + h * D);
        } else {
          weighted_sum_avx2<16>(v_head, block_table, begin, end, s.block_size, token_stride, p, acc + h * D);
        }
      }
      return;
    }
  }
#endif
  std::fill(acc, acc + H * D, 0.f);
  for_each_token(v_cache, [&](int64_t i, const float* v_row) {
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      const float* v = v_row + kv * D;
      for (int64_t h = kv * G; h < (kv + 1) * G; ++h) {
        const float p = scores[h * n + i];
        float* ah = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += p * v[d];
      }
    }
  });
}

template <typename Q, typename C>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                      const Shapes& s, at::Tensor& out) {
  const int64_t H = s.num_heads, D = s.head_dim;
  const int64_t items = s.num_seqs * s.num_splits;
  const int64_t split_len = s.blocks_per_split * s.block_size;
  // Per item: acc [H, D], then max [H], then sum [H]. Not zero-filled: every item writes all of
  // its part (an empty split its zeros), and a zero-filled vector cost a serial memset of each
  // layer's parts (~0.5 MB at 32 sequences of a few hundred tokens) while the other threads waited.
  const int64_t item_floats = H * D + 2 * H;
  const std::unique_ptr<float[]> partial(new float[static_cast<size_t>(items * item_floats)]);

  const Q* q_ptr = q.data_ptr<Q>();
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();

  // at::parallel_for gives each thread one contiguous range, and the items' costs are uneven (a
  // sequence's last split is short, a short sequence's later ones empty), so threads are dealt
  // items instead: item i of split-major order goes to thread i mod threads, and neighbours in
  // that order (the same split of consecutive sequences) cost about the same.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t thread = first; thread < last; ++thread) {
      for (int64_t i = thread; i < items; i += threads) {
        const int64_t split = i / s.num_seqs, seq = i % s.num_seqs;
        const int64_t begin = split * split_len, end = std::min(lens[seq], begin + split_len);
        float* part = partial.get() + (seq * s.num_splits + split) * item_floats;
        if (begin >= end) {  // this sequence is shorter than the longest: an empty split
          std::fill(part, part + item_floats, 0.f);
          continue;
        }
        attend_split<Q, C>(q_ptr + seq * q.stride(0), k_ptr, v_ptr, tables + seq * s.max_blocks, begin, end,
                        scale, s, part, part + H * D, part + H * D + H);
      }
    }
  });

  // Combine the splits of each sequence: rescale each to the common maximum, then normalise.
  at::parallel_for(0, s.num_seqs, 1, [&](int64_t first, int64_t last) {
    std::vector<float> o(D);
    for (int64_t seq = first; seq < last; ++seq) {
      const float* parts = partial.get() + seq * s.num_splits * item_floats;
      for (int64_t h = 0; h < H; ++h) {
        float m = -FLT_MAX;
        for (int64_t i = 0; i < s.num_splits; ++i) {
          const float* part = parts + i * item_floats;
          if (part[H * D + H + h] > 0.f) m = std::max(m, part[H * D + h]);
        }
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t i = 0; i < s.num_splits; ++i) {
          const float* part = parts + i * item_floats;
          const float sum = part[H * D + H + h];
          if (sum == 0.f) continue;  // an empty split
          const float w = std::exp(part[H * D + h] - m);
          total += w * sum;
          for (int64_t d = 0; d < D; ++d) o[d] += w * part[h * D + d];
        }
        Q* dst = out_ptr + (seq * H + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(o[d] / total);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [seqs, heads, dim], caches [blocks, block, kv_heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache differ in dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "tables must be contiguous");
  Shapes s{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1), 0, 0};
  TORCH_CHECK(k_cache.size(3) == s.head_dim && s.num_heads % s.num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == s.num_seqs && context_lens.size(0) == s.num_seqs, "one table per sequence");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= s.max_blocks * s.block_size, "context length ", lens[i],
                " does not fit its block table");
    max_len = std::max(max_len, lens[i]);
  }
  s.blocks_per_split = std::max<int64_t>(1, kSplitTokens / s.block_size);
  const int64_t split_len = s.blocks_per_split * s.block_size;
  s.num_splits = (max_len + split_len - 1) / split_len;

  at::Tensor out = at::empty({s.num_seqs, s.num_heads, s.head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    using q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
      decode_attention<q_t, scalar_t>(q, k_cache, v_cache, block_tables, context_lens, static_cast<float>(scale), s,
                                      out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
