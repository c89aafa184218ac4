// The quantized matmuls as C++ functions, for kernels that call them without the dispatcher
// (decode_layer.cpp). Arguments as the ops `yaie::quant_matmul` (quant_matmul.cpp) and
// `yaie::kquant_matmul` (kquant.cpp) take them.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace yaie_quant {

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t isa);

// Whether this CPU runs the kernels' ISA path `isa` (quant_common.h's Isa).
bool isa_supported(int64_t isa);

}  // namespace yaie_quant

namespace yaie_kquant {

at::Tensor matmul(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t isa);

}  // namespace yaie_kquant
