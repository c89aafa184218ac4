// The gated activation of a quantized model's MLP, in one pass: out = silu(gate) * up, with
// gate and up the two halves of each row of the fused gate_up projection's output.
//
//   gate_up [rows, 2 * inter]  ->  out [rows, inter],  out[r, i] = gate / (1 + exp(-gate)) * up
//
// As PyTorch ops this is two dispatches, a temporary and two passes (at::silu, then mul_), which
// at one decode row cost more than the work. It is not bit-identical to them: the exponential
// here is the C library's (vectorized, where glibc's libmvec has it, under -ffast-math), not
// PyTorch's, so the two differ by about an ulp. That is why only quantized MLPs use it: their
// results already differ from the dense model's by the weights' rounding to 4-8 bits, and when
// decoding, their down projection rounds this very output to 8 bits (quant_matmul.cpp); an ulp
// is far below both. A dense model keeps PyTorch's silu, and with it its bit-exact agreement
// with transformers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace {

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous(), "gate_up must be contiguous float32");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Decode steps have a handful of rows: they stay on this thread (waking the pool costs more).
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* gate = in + r * 2 * inter;
      const float* up = gate + inter;
      float* orow = o + r * inter;
      // The exponent is capped: with -ffast-math, dividing by an infinite 1 + exp(-gate) (a
      // gate below -88) gives NaN, not 0. Past the cap silu is below 1e-33 either way.
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        orow[i] = gate[i] / (1.f + std::exp(std::min(-gate[i], 80.f))) * up[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(yaie, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
