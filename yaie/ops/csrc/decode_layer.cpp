// The decoder layers for a decoding step, in one call: what DecoderLayer.forward does
// (yaie/model/llama.py), layer after layer, when every token of the step is a sequence's next
// token and the four projections hold quantized weights or oneDNN-packed dense ones. Per layer:
//
//   h        = add_rms_norm(x, residual, input_norm)         residual += x, in place
//   q, k, v  = split(h @ qkv_proj^T)                         [rows, heads | kv_heads | kv_heads, dim]
//   q, k     = rope(q, k)                                    in place
//   caches  <- k, v                                          at each row's slot
//   o        = paged_decode_attention(q, caches)             [rows, heads, dim]
//   h        = add_rms_norm(o @ o_proj^T, residual, post_attention_norm)
//   gate, up = split(h @ gate_up_proj^T)
//   x        = (silu(gate) * up) @ down_proj^T                one native pass if down_proj is quantized
//
// The steps are the same kernels the Python path calls, in the same order, so the result is the
// same to the bit. What goes is the Python between them: a one-token step makes ~20 Python-level
// ops per layer, and with weights four to eight times smaller than fp32 they cost as much as its
// matmuls (with fp32 weights, a third as much). The layers' weights and KV caches are handed over
// once, in a DecodeStack: converting a layer's twenty arguments at every call took longer than
// most of its kernels.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "quant_matmul.h"

namespace {

// The other kernels, found by name in the dispatcher on first use: the order in which a
// library's files register their ops is not defined, so not at load time.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Whether a projection as the layer passes it (see project) holds a dense weight.
bool is_dense(const c10::List<std::optional<at::Tensor>>& weight) {
  return weight.size() == 2 && weight.get(0).has_value();
}

// A projection as the layer passes it (yaie/model/fused_decode.py): QuantizedLinear, [qweight,
// scales, mins or None, bias or None]; KQuantLinear, [None, bias or None, part, ...]; dense,
// [oneDNN-packed weight, bias or None] (yaie/model/linear.py).
at::Tensor project(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weight, int64_t out_features,
                   int64_t isa) {
  TORCH_CHECK(weight.size() >= 2, "a projection is [qweight, scales, mins, bias], [None, bias, parts...] or "
              "[packed weight, bias]");
  const std::optional<at::Tensor> first = weight.get(0);
  if (!first.has_value()) {
    std::vector<at::Tensor> parts;
    for (size_t p = 2; p < weight.size(); ++p) parts.push_back(*weight.get(p));
    return yaie_kquant::matmul(x, parts, weight.get(1), out_features, isa);
  }
  if (weight.size() == 2) {
    static const auto linear =
        find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                           c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>(
            "mkldnn::_linear_pointwise");
    return linear.call(x, *first, weight.get(1), "none", c10::List<std::optional<c10::Scalar>>(), "");
  }
  const std::optional<at::Tensor> scales = weight.get(1);
  TORCH_CHECK(weight.size() == 4 && scales.has_value(), "a quantized projection needs its scales");
  return yaie_quant::quant_matmul(x, *first, *scales, weight.get(2), weight.get(3), out_features, isa);
}

at::Tensor decode_layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& input_norm, const at::Tensor& post_attention_norm, double eps,
                        const c10::List<std::optional<at::Tensor>>& qkv_proj,
                        const c10::List<std::optional<at::Tensor>>& o_proj,
                        const c10::List<std::optional<at::Tensor>>& gate_up_proj,
                        const c10::List<std::optional<at::Tensor>>& down_proj, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t intermediate_size, int64_t isa) {
  static const auto add_rms_norm =
      find_op<at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, double)>("yaie::add_rms_norm");
  static const auto apply_rope_ =
      find_op<at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&)>("yaie::apply_rope_");
  static const auto write_kv =
      find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&)>(
          "yaie::write_kv");
  static const auto silu_and_mul = find_op<at::Tensor(const at::Tensor&)>("yaie::silu_and_mul");
  static const auto paged_decode_attention =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double)>("yaie::paged_decode_attention");

  TORCH_CHECK(x.dim() == 2, "x must be [rows, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1), head_dim = k_cache.size(3);
  const int64_t heads = num_heads + 2 * num_kv_heads;

  at::Tensor h = add_rms_norm.call(x, residual, input_norm, eps);
  at::Tensor qkv = project(h, qkv_proj, heads * head_dim, isa).view({rows, heads, head_dim});
  at::Tensor qk = qkv.narrow(1, 0, num_heads + num_kv_heads);
  apply_rope_.call(qk, cos, sin);
  write_kv.call(qkv.narrow(1, num_heads, num_kv_heads), qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads),
                slot_mapping, k_cache, v_cache);
  const at::Tensor o = paged_decode_attention.call(qkv.narrow(1, 0, num_heads), k_cache, v_cache, block_tables,
                                                   context_lens, std::pow(static_cast<double>(head_dim), -0.5));

  h = add_rms_norm.call(project(o.view({rows, num_heads * head_dim}), o_proj, hidden, isa), residual,
                        post_attention_norm, eps);
  const at::Tensor gate_up = project(h, gate_up_proj, 2 * intermediate_size, isa);
  // A quantized down projection takes the native silu * up (csrc/activation.cpp says why only it),
  // as QuantizedLinear's and KQuantLinear's silu_mul_forward do.
  const at::Tensor act = !is_dense(down_proj)
                             ? silu_and_mul.call(gate_up)
                             : at::silu(gate_up.narrow(1, 0, intermediate_size))
                                   .mul_(gate_up.narrow(1, intermediate_size, intermediate_size));
  return project(act, down_proj, hidden, isa);
}

// One layer as decode_layer takes it: its weights and its KV caches.
struct Layer {
  at::Tensor input_norm, post_attention_norm;
  double eps;
  c10::List<std::optional<at::Tensor>> qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
  int64_t num_heads, num_kv_heads, intermediate_size;
};

// A model's decoder layers, in order, built once for a KV cache (yaie/model/fused_decode.py).
// Holding the tensors keeps them alive; the caches are written in place at every step, which
// the op's schema cannot say of tensors it does not take as arguments.
struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_attention_norm, double eps,
                 c10::List<std::optional<at::Tensor>> qkv, c10::List<std::optional<at::Tensor>> o,
                 c10::List<std::optional<at::Tensor>> gate_up, c10::List<std::optional<at::Tensor>> down,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads,
                 int64_t intermediate_size) {
    layers.push_back({input_norm, post_attention_norm, eps, std::move(qkv), std::move(o), std::move(gate_up),
                      std::move(down), k_cache, v_cache, num_heads, num_kv_heads, intermediate_size});
  }
};

// Every layer of `stack` over x: returns the last layer's MLP output; residual is updated in
// place, and each layer's K/V cache at the rows' slots.
at::Tensor decode_layers(const at::Tensor& x, at::Tensor& residual, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, const c10::intrusive_ptr<DecodeStack>& stack, int64_t isa) {
  at::Tensor h = x;
  for (Layer& l : stack->layers) {
    h = decode_layer(h, residual, cos, sin, l.input_norm, l.post_attention_norm, l.eps, l.qkv, l.o, l.gate_up,
                     l.down, l.k_cache, l.v_cache, slot_mapping, block_tables, context_lens, l.num_heads,
                     l.num_kv_heads, l.intermediate_size, isa);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(yaie, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer);
  m.def(
      "decode_layers(Tensor x, Tensor(a!) residual, Tensor cos, Tensor sin, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, __torch__.torch.classes.yaie.DecodeStack stack, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(yaie, CPU, m) { m.impl("decode_layers", &decode_layers); }
