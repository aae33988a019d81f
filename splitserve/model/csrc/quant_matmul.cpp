// y = x W^T for a weight kept in a GGUF block format (Q8_0, Q4_0, Q4_1), as llama.cpp
// multiplies it: each row of x is quantized to int8 per block of 32 (scale amax/127),
// each block's dot product is an exact int32 sum of int8 x int8 (Q8_0) or uint4 x int8
// (Q4_0/Q4_1) products, scaled in float32 by the two blocks' scales. The weight is the
// file's bytes, row by row: a Q8_0 block is an fp16 scale d and 32 int8 (w = d q), a Q4_0
// block d and 16 bytes of nibbles (w = d (q - 8)), a Q4_1 block d, an fp16 minimum m and
// 16 bytes (w = d q + m); byte j holds element j in its low nibble and element j + 16 in
// its high one. Three paths, all compiled in (-march=native) and chosen per call:
// AVX-512 VNNI (vpdpbusd on 256-bit registers, AVX512_VNNI + AVX512VL), AVX2 (vpmaddubsw +
// vpmaddwd), scalar. Rows of the output are split over threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"

namespace {

using namespace splitserve_quant;

constexpr int64_t kBlock = 32;
// GGML's type numbers, as the file and gguf.GGMLQuantizationType name them
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    default: TORCH_CHECK(false, "quant_linear: unsupported GGML type ", qtype);
  }
  return 0;
}

// x's rows quantized per 32-block: int8 values, each block's scale d and d * sum(q)
// (what Q4_0's offset and Q4_1's minimum multiply).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
};

template <typename T>
void quantize_rows(QuantizedRows& out, const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  out.q.resize(rows * k);
  out.scale.resize(rows * blocks);
  out.scaled_sum.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t index = begin; index < end; ++index) {
      const T* src = x + index * kBlock;  // row-major and contiguous: block index = row * blocks + b
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) {
        values[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float d = amax / 127.0f;
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.q.data() + index * kBlock;
      int sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
        sum += q[i];
      }
      out.scale[index] = d;
      out.scaled_sum[index] = d * static_cast<float>(sum);
    }
  });
}

// One block's integer dot product: the weight's 32 values (int8 for Q8_0, the unsigned
// nibbles for Q4) times x's 32 int8 values.
inline int32_t block_dot_scalar(int64_t qtype, const uint8_t* wq, const int8_t* xq) {
  int32_t sum = 0;
  if (qtype == kQ8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(wq);
    for (int64_t i = 0; i < kBlock; ++i) sum += static_cast<int32_t>(w[i]) * xq[i];
  } else {
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      sum += static_cast<int32_t>(wq[j] & 0x0F) * xq[j] + static_cast<int32_t>(wq[j] >> 4) * xq[j + 16];
    }
  }
  return sum;
}

#if defined(__AVX2__)
inline __m256i unpack_nibbles(const uint8_t* wq) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_set_m128i(high, low);  // elements 0..15, then 16..31
}

// products of unsigned u and signed s bytes summed into 8 int32 lanes
template <int64_t Isa>
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (Isa == kVnni) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
  // |u| <= 127 (Q8_0: |x|) or 15, |s| <= 128: a pair's sum fits int16 without saturating
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

template <int64_t Q>
constexpr int64_t kStride = Q == kQ8_0 ? 34 : (Q == kQ4_0 ? 18 : 20);  // block_bytes(Q), at compile time

// R weight rows (row_bytes apart) against one row of x. One FMA chain per row, in block
// order: four independent accumulators within a row (with the F16C conversion, on a
// loaded machine: the lm_head shape 3.8 -> 1.3 ms) changed the summation order and with
// it the demo model's greedy answer to the README's question, a 0.09-logit tie
// (docs/engine-kernels.md). Several rows at once give the core independent chains to
// overlap without touching any row's order: each row's result is the one-row loop's,
// bit for bit. x's block (and Q8_0's |x|) is loaded once for all R rows. `prefetch`, if
// set, is the next group's first byte: its lines are requested as this group is read,
// R * stride bytes a block (the group's rows are contiguous, so the next one is too).
template <int64_t Isa, int64_t Q, int R>
inline void rows_dot_simd(const uint8_t* w, int64_t row_bytes, const int8_t* xq, const float* xd,
                          const float* xs, int64_t blocks, const uint8_t* prefetch, float* out) {
  constexpr int64_t stride = kStride<Q>;
  __m256 acc[R];
  float offset_sum[R];  // Q4_0's -8 d_w and Q4_1's m_w, times d_x sum(q_x)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset_sum[r] = 0.0f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const float x_scale = xd[b];
    if (prefetch != nullptr) {
      for (int64_t offset = 0; offset < R * stride; offset += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + b * R * stride + offset), _MM_HINT_T0);
      }
    }
    [[maybe_unused]] __m256i x_abs;
    if constexpr (Q == kQ8_0) x_abs = _mm256_sign_epi8(x, x);
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * row_bytes + b * stride;
      const float dw = half_to_float(block);
      __m256i products;
      if constexpr (Q == kQ8_0) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
        // u8 x s8 instructions: |x| times w with x's sign moved onto it
        products = dot_u8_s8<Isa>(x_abs, _mm256_sign_epi8(wv, x));
      } else {
        products = dot_u8_s8<Isa>(unpack_nibbles(block + (Q == kQ4_1 ? 4 : 2)), x);
        offset_sum[r] = std::fma(Q == kQ4_1 ? half_to_float(block + 2) : -8.0f * dw, xs[b], offset_sum[r]);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x_scale), _mm256_cvtepi32_ps(products), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(acc[r]) + offset_sum[r];
}

constexpr int kGroupRows = 4;  // weight rows per group: 4 chains hide the FMA latency

// The SIMD paths over one thread's output columns [begin, end): groups of kGroupRows
// weight rows, each multiplied by a tile of x's rows (from L1 after the first row), the
// first tile prefetching the next group.
template <typename T, int64_t Isa, int64_t Q>
void quant_columns_simd(T* y, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t rows,
                        int64_t n, int64_t k, const float* bias, int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock;
  float dots[kGroupRows];
  for (int64_t tile = 0; tile < rows; tile += kTokenTile) {
    const int64_t tile_end = std::min(rows, tile + kTokenTile);
    int64_t col = begin;
    for (; col + kGroupRows <= end; col += kGroupRows) {
      const uint8_t* group = w + col * row_bytes;
      const bool has_next = col + 2 * kGroupRows <= end;
      for (int64_t r = tile; r < tile_end; ++r) {
        const uint8_t* prefetch = r == 0 && has_next ? group + kGroupRows * row_bytes : nullptr;
        rows_dot_simd<Isa, Q, kGroupRows>(group, row_bytes, xq.q.data() + r * k, xq.scale.data() + r * blocks,
                                          xq.scaled_sum.data() + r * blocks, blocks, prefetch, dots);
        for (int j = 0; j < kGroupRows; ++j) {
          y[r * n + col + j] = static_cast<T>(dots[j] + (bias ? bias[col + j] : 0.0f));
        }
      }
    }
    for (; col < end; ++col) {
      for (int64_t r = tile; r < tile_end; ++r) {
        rows_dot_simd<Isa, Q, 1>(w + col * row_bytes, row_bytes, xq.q.data() + r * k,
                                 xq.scale.data() + r * blocks, xq.scaled_sum.data() + r * blocks, blocks,
                                 nullptr, dots);
        y[r * n + col] = static_cast<T>(dots[0] + (bias ? bias[col] : 0.0f));
      }
    }
  }
}

template <typename T, int64_t Isa>
void quant_columns_simd(int64_t qtype, T* y, const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                        int64_t rows, int64_t n, int64_t k, const float* bias, int64_t begin, int64_t end) {
  switch (qtype) {
    case kQ8_0: return quant_columns_simd<T, Isa, kQ8_0>(y, w, row_bytes, xq, rows, n, k, bias, begin, end);
    case kQ4_0: return quant_columns_simd<T, Isa, kQ4_0>(y, w, row_bytes, xq, rows, n, k, bias, begin, end);
    default: return quant_columns_simd<T, Isa, kQ4_1>(y, w, row_bytes, xq, rows, n, k, bias, begin, end);
  }
}
#endif

float row_dot_scalar(int64_t qtype, const uint8_t* w, const int8_t* xq, const float* xd, const float* xs,
                     int64_t blocks) {
  const int64_t stride = block_bytes(qtype);
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += stride) {
    const float dw = half_to_float(w);
    const uint8_t* values = w + (qtype == kQ4_1 ? 4 : 2);
    const float products = static_cast<float>(block_dot_scalar(qtype, values, xq + b * kBlock));
    sum += dw * xd[b] * products;
    if (qtype == kQ4_0) sum -= 8.0f * dw * xs[b];
    if (qtype == kQ4_1) sum += half_to_float(w + 2) * xs[b];
  }
  return sum;
}

template <typename T>
void quant_linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                       const std::optional<at::Tensor>& bias, int64_t isa) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0), blocks = k / kBlock;
  const int64_t row_bytes = weight.size(1);
  QuantizedRows xq;
  quantize_rows<T>(xq, x.data_ptr<T>(), rows, k);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* bias_values = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* y = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (isa == kVnni) return quant_columns_simd<T, kVnni>(qtype, y, w, row_bytes, xq, rows, n, k, bias_values, begin, end);
#endif
    if (isa == kAvx2) return quant_columns_simd<T, kAvx2>(qtype, y, w, row_bytes, xq, rows, n, k, bias_values, begin, end);
#endif
    // a weight row (a few hundred bytes) is read once per tile of x's rows, from L1 after the first
    for (int64_t tile = 0; tile < rows; tile += kTokenTile) {
      const int64_t tile_end = std::min(rows, tile + kTokenTile);
      for (int64_t col = begin; col < end; ++col) {
        const uint8_t* w_row = w + col * row_bytes;
        const float add = bias_values ? bias_values[col] : 0.0f;
        for (int64_t r = tile; r < tile_end; ++r) {
          const float dot = row_dot_scalar(qtype, w_row, xq.q.data() + r * k, xq.scale.data() + r * blocks,
                                           xq.scaled_sum.data() + r * blocks, blocks);
          y[r * n + col] = static_cast<T>(dot + add);
        }
      }
    }
  });
}

void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                  const std::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "quant_linear: x [M, K] contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "quant_linear: the weight is uint8 blocks [N, K / 32 * block bytes]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && weight.size(1) == k / kBlock * block_bytes(qtype),
              "quant_linear: K must be a multiple of 32 and match the weight's blocks");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0) && out.scalar_type() == x.scalar_type(),
              "quant_linear: out [M, N] in x's dtype");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "quant_linear: bias float32 [N]");
  }
  const int64_t chosen = isa < 0 ? best_isa() : isa;
  TORCH_CHECK(chosen <= best_isa(), "quant_linear: kernel path ", isa, " is not compiled in (best ", best_isa(), ")");
  if (x.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat) {
    quant_linear_impl<float>(out, x, weight, qtype, bias, chosen);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear: x float32 or bfloat16");
    quant_linear_impl<c10::BFloat16>(out, x, weight, qtype, bias, chosen);
  }
}

int64_t quant_linear_best_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("quant_linear_best_isa() -> int", &quant_linear_best_isa);
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, int isa) -> ()",
        &quant_linear);
}
