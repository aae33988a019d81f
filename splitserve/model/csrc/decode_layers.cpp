// All the layers of a dense decoder for one decode step, in one call from Python.
//
// At batch 1 a layer's math is ~0.4 ms of weight reads, and the Python around its nine
// kernel calls (module calls, wrappers, argument checks, views, allocations) costs ~10 us
// a call: a quarter of a SmolLM2 step. This op runs the same registered kernels, in the
// same order and on the same kinds of buffers, as DecoderModel.forward does for a
// decode-only step, so its outputs are bit-for-bit the Python path's; each call goes
// through the dispatcher (~1 us) and the step's buffers are allocated once, not per layer.
//
// Each layer is 11 weights (None where absent) and 4 linears described by 2 ints each:
//   0 qkv_proj.weight  1 qkv_proj.bias  2 q/k norm weights (Qwen3)  3 o_proj.weight  4 o_proj.bias
//   5 post_attention_layernorm.weight  6 gate_up_proj.weight  7 gate_up_proj.bias
//   8 down_proj.weight  9 down_proj.bias  10 the next layer's input_layernorm.weight (None last)
// linear kinds: (0, 0) bf16 GEMV on a plain weight; (1, qtype) quant_linear and (2, qtype)
// quant_linear_k on GGUF blocks. The residual is updated in place; `normed` holds the first
// layer's normalized input and is reused; the last layer's MLP output is returned (the
// caller adds it into the residual for the rows it samples, as the Python path does).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kWeightsPerLayer = 11;
constexpr int64_t kKindsPerLayer = 8;  // 4 linears x (kernel, qtype)

using OptTensor = std::optional<at::Tensor>;

// the registered kernels' exact C++ signatures (the dispatcher checks them)
using AddRmsNormFn = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, double);
using SiluAndMulFn = void(at::Tensor, const at::Tensor&);
using RopeAndCacheFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const OptTensor&, double,
                            at::Tensor, const at::Tensor&, int64_t, int64_t);
using DecodeAttentionFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double);
using GemvFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const OptTensor&);
using QuantLinearFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, int64_t);

template <class Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Kernels {
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm = find_op<AddRmsNormFn>("splitserve_cpu::add_rms_norm");
  c10::TypedOperatorHandle<SiluAndMulFn> silu_and_mul = find_op<SiluAndMulFn>("splitserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<RopeAndCacheFn> rope_and_cache =
      find_op<RopeAndCacheFn>("splitserve_cpu::rope_and_cache");
  c10::TypedOperatorHandle<DecodeAttentionFn> decode_attention =
      find_op<DecodeAttentionFn>("splitserve_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<GemvFn> gemv = find_op<GemvFn>("splitserve_cpu::gemv_bf16");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear = find_op<QuantLinearFn>("splitserve_cpu::quant_linear");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear_k =
      find_op<QuantLinearFn>("splitserve_cpu::quant_linear_k");
};

const Kernels& kernels() {
  static const Kernels k;  // looked up on first use: every fragment is registered by then
  return k;
}

struct LinearKind {
  int64_t kernel;
  int64_t qtype;
};

void linear(const Kernels& k, at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
            LinearKind kind, int64_t isa) {
  switch (kind.kernel) {
    case 0:
      k.gemv.call(out, x, weight, bias);
      return;
    case 1:
      k.quant_linear.call(out, x, weight, kind.qtype, bias, isa);
      return;
    case 2:
      k.quant_linear_k.call(out, x, weight, kind.qtype, bias, isa);
      return;
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear kernel ", kind.kernel);
  }
}

// by value: a c10::List hands out copies (a reference into one would dangle)
at::Tensor required(const c10::List<OptTensor>& weights, int64_t index, const char* what) {
  OptTensor w = weights.get(index);
  TORCH_CHECK(w.has_value(), "decode_layers: ", what, " is missing");
  return *std::move(w);
}

at::Tensor decode_layers(at::Tensor residual, at::Tensor normed, const c10::List<OptTensor>& weights,
                         at::IntArrayRef kinds, at::Tensor kv_cache, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double rms_eps,
                         double qk_eps, double scale, int64_t isa) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "decode_layers: kv_cache [layers, 2, blocks, block_size, kv_heads, head_dim] contiguous");
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer, "decode_layers: ",
              kWeightsPerLayer, " weights a layer");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers * kKindsPerLayer, "decode_layers: ", kKindsPerLayer,
              " kinds a layer");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && normed.sizes() == residual.sizes() &&
                  normed.is_contiguous(),
              "decode_layers: residual and normed [tokens, hidden] contiguous");
  TORCH_CHECK(!weights.get(layers * kWeightsPerLayer - 1).has_value(),
              "decode_layers: the last layer has no next input norm");
  const Kernels& k = kernels();
  const int64_t tokens = residual.size(0), hidden = residual.size(1);
  const int64_t head_dim = kv_cache.size(-1), q_size = num_heads * head_dim;
  auto kind = [&](int64_t layer, int64_t index) {
    return LinearKind{kinds[layer * kKindsPerLayer + 2 * index], kinds[layer * kKindsPerLayer + 2 * index + 1]};
  };
  // the step's buffers, shared by every layer (each is fully written before it is read)
  const auto options = residual.options();
  at::Tensor qkv = at::empty({tokens, required(weights, 0, "qkv_proj.weight").size(0)}, options);
  at::Tensor attention = at::empty({tokens, num_heads, head_dim}, options);
  at::Tensor attention_rows = attention.view({tokens, q_size});
  at::Tensor attention_out = at::empty({tokens, hidden}, options);
  at::Tensor mlp_in = at::empty({tokens, hidden}, options);
  at::Tensor gate_up = at::empty({tokens, required(weights, 6, "gate_up_proj.weight").size(0)}, options);
  at::Tensor activation = at::empty({tokens, gate_up.size(1) / 2}, options);
  at::Tensor mlp_out = at::empty({tokens, hidden}, options);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t w = i * kWeightsPerLayer;
    linear(k, qkv, normed, required(weights, w + 0, "qkv_proj.weight"), weights.get(w + 1), kind(i, 0), isa);
    at::Tensor kv_layer = kv_cache.select(0, i);
    k.rope_and_cache.call(qkv, cos, sin, weights.get(w + 2), qk_eps, kv_layer, slot_mapping, num_heads,
                          num_kv_heads);
    k.decode_attention.call(attention, q, kv_layer, block_tables, context_lens, scale);
    linear(k, attention_out, attention_rows, required(weights, w + 3, "o_proj.weight"), weights.get(w + 4),
           kind(i, 1), isa);
    k.add_rms_norm.call(mlp_in, residual, attention_out, required(weights, w + 5, "post norm"), rms_eps);
    linear(k, gate_up, mlp_in, required(weights, w + 6, "gate_up_proj.weight"), weights.get(w + 7), kind(i, 2),
           isa);
    k.silu_and_mul.call(activation, gate_up);
    linear(k, mlp_out, activation, required(weights, w + 8, "down_proj.weight"), weights.get(w + 9), kind(i, 3),
           isa);
    if (i + 1 < layers) {
      k.add_rms_norm.call(normed, residual, mlp_out, required(weights, w + 10, "next input norm"), rms_eps);
    }
  }
  return mlp_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) residual, Tensor(b!) normed, Tensor?[] weights, int[] kinds, Tensor(c!) kv_cache, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, "
      "int num_kv_heads, float rms_eps, float qk_eps, float scale, int isa) -> Tensor",
      &decode_layers);
}
