// The residual add and the RMSNorm that follows it, in one pass over the hidden states.
//
// Every decoder sublayer ends with `residual += out` and the next one starts with
// `rms_norm(residual)`. As separate PyTorch ops that is two dispatches and three passes over the
// activations, sixty times per decode step; here it is one call:
//
//   residual[t] = x[t] + residual[t]                              (written in place)
//   out[t]      = residual[t] / sqrt(mean(residual[t]^2) + eps) * weight

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,
                       float eps) {
  // Rows are independent; a decode step has a handful, a prompt thousands. Small batches stay on
  // this thread: waking the OpenMP pool would cost more than the work.
  const int64_t grain = std::max<int64_t>(1, 32768 / hidden);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * hidden;
      T* rr = residual + r * hidden;
      T* orow = out + r * hidden;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = static_cast<float>(xr[i]) + static_cast<float>(rr[i]);
        rr[i] = static_cast<T>(v);
        sum_sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sum_sq / hidden + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        orow[i] = static_cast<T>(static_cast<float>(rr[i]) * inv * static_cast<float>(weight[i]));
      }
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be [tokens, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight must share a dtype");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) { m.impl("add_rms_norm", &add_rms_norm); }
