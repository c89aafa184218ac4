// The quantized matmul as a C++ function, for kernels that call it without the dispatcher
// (decode_layer.cpp). Arguments as the op `yaie::quant_matmul` takes them (quant_matmul.cpp).

#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace yaie_quant {

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t isa);

}  // namespace yaie_quant
