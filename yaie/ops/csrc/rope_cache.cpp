// The two small steps between the QKV projection and attention, as one call each:
//
//   apply_rope_   rotate the q and k heads in place by their positions' cos/sin tables (the
//                 full-width tables RotaryEmbedding makes: cos = [c, c], sin = [-s, s], so
//                 x' = x * cos + swap_halves(x) * sin);
//   write_kv      copy each new token's k and v heads into its cache slot, rounded to the
//                 cache's dtype where it is narrower (--kv-cache-dtype).
//
// In PyTorch these are five dispatches (chunk, mul, cat, addcmul, two index_copy_) per layer;
// at decode batch sizes the dispatching costs more than the arithmetic.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

namespace {

// Rows are independent; few rows (decoding) stay on this thread, many (prompts) are split.
constexpr int64_t kGrainElements = 32768;

void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), name,
              " must be [tokens, heads, head_dim] with each token's heads contiguous");
}

template <typename T>
void rope_rows(T* x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t D, const T* cos,
               const T* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / (heads * D)), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + t * row_stride + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
          xh[i] = static_cast<T>(x1 * static_cast<float>(c[i]) + x2 * static_cast<float>(s[i]));
          xh[i + half] =
              static_cast<T>(x2 * static_cast<float>(c[i + half]) + x1 * static_cast<float>(s[i + half]));
        }
      }
    }
  });
}

// Each token t's row of k and v heads [kv_heads * head_dim] into its cache slot; S is the
// source's element type, C the cache's.
template <typename S, typename C>
void copy_rows(const S* k, const S* v, int64_t k_stride, int64_t v_stride, const int64_t* slots, int64_t tokens,
               int64_t row, C* k_cache, C* v_cache) {
  // One copy of a row: a memcpy when the types agree, else a conversion rounding to nearest even
  // (as torch's .to() does).
  auto copy = [row](const S* src, C* dst) {
    if constexpr (std::is_same_v<S, C>) {
      std::memcpy(dst, src, row * sizeof(C));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < row; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
    }
  };
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(C));
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements * 4 / row_bytes), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      copy(k + t * k_stride, k_cache + slots[t] * row);
      copy(v + t * v_stride, v_cache + slots[t] * row);
    }
  });
}

at::Tensor& apply_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(x, "x");
  const int64_t tokens = x.size(0), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * D && sin.numel() == tokens * D,
              "cos and sin must be contiguous [tokens, 1, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_rope_", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), tokens, x.size(1), D, cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>());
  });
  return x;
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping, at::Tensor& k_cache,
              at::Tensor& v_cache) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous and alike");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "caches must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v must share a dtype, and so must the caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 [tokens]");
  const int64_t tokens = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv", [&] {
      copy_rows<src_t, scalar_t>(k.data_ptr<src_t>(), v.data_ptr<src_t>(), k.stride(0), v.stride(0), slots, tokens,
                                 k.size(1) * k.size(2), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.def("apply_rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("write_kv(Tensor k, Tensor v, Tensor slot_mapping, Tensor(a!) k_cache, Tensor(b!) v_cache) -> ()");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) {
  m.impl("apply_rope_", &apply_rope_);
  m.impl("write_kv", &write_kv);
}
