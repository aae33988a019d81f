// All the layers of a dense decoder for one step, in one call from Python.
//
// At batch 1 a layer's math is ~0.4 ms of weight reads, and the Python around its nine
// kernel calls (module calls, wrappers, argument checks, views, allocations) costs ~10 us
// a call: a quarter of a SmolLM2 decode step, and as much again in a short prompt's
// prefill. This op runs the same registered kernels, in the same order and on buffers of
// the same shapes, as DecoderModel's module-by-module forward, so its outputs are that
// path's bit for bit; each call goes through the dispatcher (~1 us).
//
// A step is `decodes` one-token requests first, then prefill chunks (row start, rows,
// cached positions before it, its block table), as AttentionMetadata orders them. Each
// layer is 11 weights (None where absent) and 4 linears described by 2 ints each:
//   0 qkv_proj.weight  1 qkv_proj.bias  2 q/k norm weights (Qwen3)  3 o_proj.weight  4 o_proj.bias
//   5 post_attention_layernorm.weight  6 gate_up_proj.weight  7 gate_up_proj.bias
//   8 down_proj.weight  9 down_proj.bias  10 the next layer's input_layernorm.weight (None last)
// linear kinds: (0, 0) the bf16 GEMV on a plain weight; (1, qtype) quant_linear and
// (2, qtype) quant_linear_k on GGUF blocks (each writes a buffer allocated once per step);
// (3, 0) oneDNN's packed matmul (it allocates its output). The residual is updated in place;
// `normed` holds the first layer's normalized input and is reused; the last layer's MLP
// output is returned (the caller adds it into the residual for the rows it samples).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
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
using PrefillAttentionFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                double);
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
  c10::TypedOperatorHandle<PrefillAttentionFn> prefill_attention =
      find_op<PrefillAttentionFn>("splitserve_cpu::prefill_attention");
  c10::TypedOperatorHandle<GemvFn> gemv = find_op<GemvFn>("splitserve_cpu::gemv_bf16");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear = find_op<QuantLinearFn>("splitserve_cpu::quant_linear");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear_k =
      find_op<QuantLinearFn>("splitserve_cpu::quant_linear_k");
  // called boxed: its C++ signature (string views, a list of optional scalars) is torch's
  // internal business, and a prefill-sized matmul does not notice a microsecond more
  c10::OperatorHandle packed_linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
};

const Kernels& kernels() {
  static const Kernels k;  // looked up on first use: every fragment is registered by then
  return k;
}

struct LinearKind {
  int64_t kernel;
  int64_t qtype;
};

// x times the weight: into `out` (allocated once per step), or oneDNN's own output
at::Tensor linear(const Kernels& k, at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const OptTensor& bias, LinearKind kind, int64_t isa) {
  switch (kind.kernel) {
    case 0:
      k.gemv.call(out, x, weight, bias);
      return out;
    case 1:
      k.quant_linear.call(out, x, weight, kind.qtype, bias, isa);
      return out;
    case 2:
      k.quant_linear_k.call(out, x, weight, kind.qtype, bias, isa);
      return out;
    case 3: {
      // as Linear.forward: _linear_pointwise(x, packed, bias, "none", [], "")
      torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                              std::optional<std::string>(std::string())};
      k.packed_linear.callBoxed(&stack);
      return stack[0].toTensor();
    }
    default:
      TORCH_CHECK(false, "compiled_layers: unknown linear kernel ", kind.kernel);
  }
}

// by value: a c10::List hands out copies (a reference into one would dangle)
at::Tensor required(const c10::List<OptTensor>& weights, int64_t index, const char* what) {
  OptTensor w = weights.get(index);
  TORCH_CHECK(w.has_value(), "compiled_layers: ", what, " is missing");
  return *std::move(w);
}

struct Chunk {
  int64_t start, rows, position_start;
  at::Tensor block_table;
};

at::Tensor compiled_layers(at::Tensor residual, at::Tensor normed, const c10::List<OptTensor>& weights,
                           at::IntArrayRef kinds, at::Tensor kv_cache, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& slot_mapping, int64_t decodes, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, at::IntArrayRef chunk_rows,
                           at::TensorList chunk_block_tables, int64_t num_heads, int64_t num_kv_heads,
                           double rms_eps, double qk_eps, double scale, int64_t isa) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "compiled_layers: kv_cache [layers, 2, blocks, block_size, kv_heads, head_dim] contiguous");
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(layers > 0, "compiled_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer, "compiled_layers: ",
              kWeightsPerLayer, " weights a layer");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers * kKindsPerLayer, "compiled_layers: ", kKindsPerLayer,
              " kinds a layer");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && normed.sizes() == residual.sizes() &&
                  normed.is_contiguous(),
              "compiled_layers: residual and normed [tokens, hidden] contiguous");
  TORCH_CHECK(!weights.get(layers * kWeightsPerLayer - 1).has_value(),
              "compiled_layers: the last layer has no next input norm");
  const int64_t tokens = residual.size(0), hidden = residual.size(1);
  // chunk_rows: (start, rows, position_start) per prefill chunk, after the decodes
  const int64_t num_chunks = static_cast<int64_t>(chunk_block_tables.size());
  TORCH_CHECK(static_cast<int64_t>(chunk_rows.size()) == 3 * num_chunks, "compiled_layers: 3 ints a chunk");
  std::vector<Chunk> chunks;
  int64_t covered = decodes;
  for (int64_t c = 0; c < num_chunks; ++c) {
    Chunk chunk{chunk_rows[3 * c], chunk_rows[3 * c + 1], chunk_rows[3 * c + 2], chunk_block_tables[c]};
    TORCH_CHECK(chunk.start == covered && chunk.rows > 0, "compiled_layers: chunks follow the decodes, in order");
    covered += chunk.rows;
    chunks.push_back(std::move(chunk));
  }
  TORCH_CHECK(covered == tokens, "compiled_layers: decodes and chunks cover the step's ", tokens, " tokens");
  const Kernels& k = kernels();
  const int64_t head_dim = kv_cache.size(-1), q_size = num_heads * head_dim;
  auto kind = [&](int64_t layer, int64_t index) {
    return LinearKind{kinds[layer * kKindsPerLayer + 2 * index], kinds[layer * kKindsPerLayer + 2 * index + 1]};
  };
  // the step's buffers, shared by every layer (each is fully written before it is read)
  const auto options = residual.options();
  at::Tensor qkv_buffer = at::empty({tokens, required(weights, 0, "qkv_proj.weight").size(0)}, options);
  at::Tensor attention = at::empty({tokens, num_heads, head_dim}, options);
  at::Tensor attention_rows = attention.view({tokens, q_size});
  at::Tensor attention_out_buffer = at::empty({tokens, hidden}, options);
  at::Tensor mlp_in = at::empty({tokens, hidden}, options);
  at::Tensor gate_up_buffer = at::empty({tokens, required(weights, 6, "gate_up_proj.weight").size(0)}, options);
  at::Tensor activation = at::empty({tokens, gate_up_buffer.size(1) / 2}, options);
  at::Tensor mlp_out_buffer = at::empty({tokens, hidden}, options);
  at::Tensor mlp_out;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t w = i * kWeightsPerLayer;
    at::Tensor qkv =
        linear(k, qkv_buffer, normed, required(weights, w + 0, "qkv_proj.weight"), weights.get(w + 1), kind(i, 0), isa);
    at::Tensor kv_layer = kv_cache.select(0, i);
    k.rope_and_cache.call(qkv, cos, sin, weights.get(w + 2), qk_eps, kv_layer, slot_mapping, num_heads,
                          num_kv_heads);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    if (decodes > 0) {
      k.decode_attention.call(attention.narrow(0, 0, decodes), q.narrow(0, 0, decodes), kv_layer, block_tables,
                              context_lens, scale);
    }
    for (const Chunk& chunk : chunks) {
      k.prefill_attention.call(attention.narrow(0, chunk.start, chunk.rows), q.narrow(0, chunk.start, chunk.rows),
                               kv_layer, chunk.block_table, chunk.position_start, scale);
    }
    at::Tensor attention_out = linear(k, attention_out_buffer, attention_rows,
                                      required(weights, w + 3, "o_proj.weight"), weights.get(w + 4), kind(i, 1), isa);
    k.add_rms_norm.call(mlp_in, residual, attention_out, required(weights, w + 5, "post norm"), rms_eps);
    at::Tensor gate_up = linear(k, gate_up_buffer, mlp_in, required(weights, w + 6, "gate_up_proj.weight"),
                                weights.get(w + 7), kind(i, 2), isa);
    k.silu_and_mul.call(activation, gate_up);
    mlp_out = linear(k, mlp_out_buffer, activation, required(weights, w + 8, "down_proj.weight"), weights.get(w + 9),
                     kind(i, 3), isa);
    if (i + 1 < layers) {
      k.add_rms_norm.call(normed, residual, mlp_out, required(weights, w + 10, "next input norm"), rms_eps);
    }
  }
  return mlp_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def(
      "compiled_layers(Tensor(a!) residual, Tensor(b!) normed, Tensor?[] weights, int[] kinds, Tensor(c!) kv_cache, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, int decodes, Tensor block_tables, Tensor context_lens, "
      "int[] chunk_rows, Tensor[] chunk_block_tables, int num_heads, int num_kv_heads, float rms_eps, "
      "float qk_eps, float scale, int isa) -> Tensor",
      &compiled_layers);
}
