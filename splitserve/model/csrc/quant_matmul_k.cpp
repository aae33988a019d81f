// y = x W^T for a weight kept in a GGUF K-quant format (Q4_K, Q5_K, Q6_K), as llama.cpp
// multiplies it (vec_dot_q*_K_q8_K): each row of x is quantized to int8 per super-block
// of 256 (scale amax/127) with the sums of each 16 values, and a super-block's dot product
// is an exact int32 sum over its sub-blocks of (sub-block scale) x (int dot product),
// scaled once in float32 by the two super-blocks' scales. The weight is the file's bytes,
// row by row, 256 weights per super-block:
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8],
//     128 bytes of nibbles; sub-block j of 32: w = d sc[j] q - dmin m[j]; bytes 32i..32i+31
//     hold sub-block 2i in their low nibbles and 2i + 1 in their high ones.
//   Q5_K (176 bytes): as Q4_K with 32 bytes qh after the scales (bit j of byte l: bit 4 of
//     element 32j + l), then the 128 bytes of nibbles.
//   Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
//     scales (one per 16 weights), fp16 d; w = d sc[g] (q - 32). In each half of 128:
//     element 32s + l takes ql[64h + 32 (s & 1) + l]'s low (s < 2) or high nibble and bits
//     2s, 2s + 1 of qh[32h + l].
// Paths as in quant_matmul.cpp: AVX-512 VNNI (vpmaddubsw, then vpdpwssd multiplies by the
// sub-block scale and accumulates in one instruction), AVX2 (vpmaddubsw + vpmaddwd +
// vpaddd), scalar; rows of the output are split over threads with at::parallel_for.
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

constexpr int64_t kSuper = 256;   // weights (and x values) per super-block
constexpr int64_t kSums = 16;     // x values per partial sum (Q6_K's scale groups)
constexpr int64_t kGroups = kSuper / kSums;
// GGML's type numbers, as the file and gguf.GGMLQuantizationType name them
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ5_K = 13;
constexpr int64_t kQ6_K = 14;

int64_t super_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "quant_linear_k: unsupported GGML type ", qtype);
  }
  return 0;
}

// x's rows as llama.cpp's block_q8_K: int8 values, one scale per 256, the sum of each 16
// int8 values (|sum| <= 16 * 127, an int16; what Q4_K's mins and Q6_K's -32 multiply).
struct SuperRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> sums;
};

template <typename T>
void quantize_super_rows(SuperRows& out, const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kSuper;
  out.q.resize(rows * k);
  out.scale.resize(rows * blocks);
  out.sums.resize(rows * blocks * kGroups);
  at::parallel_for(0, rows * blocks, 32, [&](int64_t begin, int64_t end) {
    float values[kSuper];
    for (int64_t index = begin; index < end; ++index) {
      const T* src = x + index * kSuper;  // row-major and contiguous: index = row * blocks + b
      float amax = 0.0f;
      for (int64_t i = 0; i < kSuper; ++i) {
        values[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float d = amax / 127.0f;
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.q.data() + index * kSuper;
      for (int64_t g = 0; g < kGroups; ++g) {
        int sum = 0;
        for (int64_t i = g * kSums; i < (g + 1) * kSums; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
          sum += q[i];
        }
        out.sums[index * kGroups + g] = static_cast<int16_t>(sum);
      }
      out.scale[index] = d;
    }
  });
}

// Q4_K's and Q5_K's 12 bytes: sub-blocks 0-3 take the low 6 bits of bytes j (scale) and
// j + 4 (min); 4-7 take a nibble of byte j + 4 and the top 2 bits of bytes j - 4 / j.
inline void unpack_scales_mins(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = packed[j] & 63;
    mins[j] = packed[j + 4] & 63;
    scales[j + 4] = (packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4);
    mins[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
  }
}

// One super-block's exact integer sum  sum_i q_w,i q_x,i  scaled per sub-block, and the
// sums the offsets multiply, for the scalar path; the SIMD paths compute the same ints.
int32_t super_dot_scalar(int64_t qtype, const uint8_t* w, const int8_t* xq, const int16_t* xs,
                         int32_t* min_sum) {
  int32_t total = 0;
  *min_sum = 0;
  if (qtype == kQ6_K) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t s = 0; s < 4; ++s) {
        for (int64_t half = 0; half < 2; ++half) {  // the two 16-groups of these 32 values
          int32_t dot = 0;
          for (int64_t l = half * 16; l < half * 16 + 16; ++l) {
            const uint8_t low = ql[64 * h + 32 * (s & 1) + l];
            const int32_t q = ((s < 2 ? low & 0x0F : low >> 4) | (((qh[32 * h + l] >> (2 * s)) & 3) << 4));
            dot += q * xq[128 * h + 32 * s + l];
          }
          const int64_t group = 8 * h + 2 * s + half;
          total += scales[group] * (dot - 32 * xs[group]);
        }
      }
    }
    return total;
  }
  uint8_t scales[8], mins[8];
  unpack_scales_mins(w + 4, scales, mins);
  const uint8_t* qh = w + 16;                               // Q5_K only
  const uint8_t* nibbles = w + (qtype == kQ5_K ? 48 : 16);
  for (int64_t j = 0; j < 8; ++j) {
    int32_t dot = 0;
    for (int64_t l = 0; l < 32; ++l) {
      const uint8_t byte = nibbles[32 * (j / 2) + l];
      int32_t q = j % 2 ? byte >> 4 : byte & 0x0F;
      if (qtype == kQ5_K) q |= ((qh[l] >> j) & 1) << 4;
      dot += q * xq[32 * j + l];
    }
    total += scales[j] * dot;
    *min_sum += mins[j] * (xs[2 * j] + xs[2 * j + 1]);
  }
  return total;
}

float row_dot_scalar(int64_t qtype, const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs,
                     int64_t blocks) {
  const int64_t stride = super_block_bytes(qtype);
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += stride) {
    int32_t min_sum;
    const int32_t dot = super_dot_scalar(qtype, w, xq + b * kSuper, xs + b * kGroups, &min_sum);
    if (qtype == kQ6_K) {
      sum += half_to_float(w + 208) * xd[b] * static_cast<float>(dot);
    } else {
      sum += xd[b] * (half_to_float(w) * static_cast<float>(dot) - half_to_float(w + 2) * static_cast<float>(min_sum));
    }
  }
  return sum;
}

#if defined(__AVX2__)
// acc + the int16 pairs of p times the int16 scale s, summed into 8 int32 lanes
template <int64_t Isa>
inline __m256i scaled_pairs(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (Isa == kVnni) return _mm256_dpwssd_epi32(acc, p, s);
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_K / Q5_K: the unsigned 4- or 5-bit q (<= 31) times int8 x: a vpmaddubsw pair is at
// most 2 * 31 * 128, no int16 saturation; the sub-block scale (<= 63) multiplies the pairs.
template <int64_t Isa, bool Five>
float row_dot_q45(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs, int64_t blocks) {
  const int64_t stride = Five ? 176 : 144;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i one_bits = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += stride) {
    uint8_t scales[8], mins[8];
    unpack_scales_mins(w + 4, scales, mins);
    const int8_t* x = xq + b * kSuper;
    const uint8_t* nibbles = w + (Five ? 48 : 16);
    __m256i high_bits = Five ? load256(w + 16) : _mm256_setzero_si256();  // bit j: sub-block j
    // four independent int32 chains, so the eight multiply-adds of a super-block need not wait
    // on each other (exact sums: any order gives the same integers; no gain measured on the
    // loaded 2-core test machine, where a matvec is ~0.1 ns a weight for every type)
    __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    for (int64_t i = 0; i < 4; ++i) {
      const __m256i packed = load256(nibbles + 32 * i);
      __m256i q_low = _mm256_and_si256(packed, low_mask);
      __m256i q_high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
      if constexpr (Five) {
        q_low = _mm256_or_si256(q_low, _mm256_slli_epi16(_mm256_and_si256(high_bits, one_bits), 4));
        high_bits = _mm256_srli_epi16(high_bits, 1);  // bit 0 of each byte: the next sub-block's
        q_high = _mm256_or_si256(q_high, _mm256_slli_epi16(_mm256_and_si256(high_bits, one_bits), 4));
        high_bits = _mm256_srli_epi16(high_bits, 1);
      }
      const __m256i p_low = _mm256_maddubs_epi16(q_low, load256(x + 64 * i));
      const __m256i p_high = _mm256_maddubs_epi16(q_high, load256(x + 64 * i + 32));
      sums[2 * (i & 1)] = scaled_pairs<Isa>(sums[2 * (i & 1)], p_low, _mm256_set1_epi16(scales[2 * i]));
      sums[2 * (i & 1) + 1] =
          scaled_pairs<Isa>(sums[2 * (i & 1) + 1], p_high, _mm256_set1_epi16(scales[2 * i + 1]));
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]), _mm256_add_epi32(sums[2], sums[3]));
    // m[j] (x's sums 2j and 2j + 1): the mins widened to 16 int16, each twice
    __m128i mins8;
    std::memcpy(&mins8, mins, 8);
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));
    const __m256i min_sum = _mm256_madd_epi16(mins16, load256(xs + b * kGroups));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w) * xd[b]), _mm256_cvtepi32_ps(sum), acc);
    acc_min = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w + 2) * xd[b]), _mm256_cvtepi32_ps(min_sum), acc_min);
  }
  return horizontal_sum(_mm256_sub_ps(acc, acc_min));
}

// Q6_K: q in 0..63 (the -32 is taken off through x's sums: 32 sum_g sc[g] sum_g(x)), so a
// vpmaddubsw pair is at most 2 * 63 * 128; each 16 values have their own int8 scale.
template <int64_t Isa>
float row_dot_q6(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs, int64_t blocks) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i two_bits = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += 210) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    const int8_t* x = xq + b * kSuper;
    // one independent int32 chain per s (exact sums: the order changes no integer)
    __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i ql0 = load256(w + 64 * h);
      const __m256i ql1 = load256(w + 64 * h + 32);
      const __m256i qh = load256(w + 128 + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low_mask), _mm256_slli_epi16(_mm256_and_si256(qh, two_bits), 4)),
          _mm256_or_si256(_mm256_and_si256(ql1, low_mask),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two_bits), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low_mask),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two_bits), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low_mask),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two_bits), 4)),
      };
      for (int64_t s = 0; s < 4; ++s) {
        const __m256i pairs = _mm256_maddubs_epi16(q[s], load256(x + 128 * h + 32 * s));
        const int64_t group = 8 * h + 2 * s;  // the low 128 bits: 16 values of this group, then the next
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(scales[group + 1]), _mm_set1_epi16(scales[group]));
        sums[s] = scaled_pairs<Isa>(sums[s], pairs, scale);
      }
    }
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]), _mm256_add_epi32(sums[2], sums[3]));
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    const __m256i offset = _mm256_madd_epi16(scales16, load256(xs + b * kGroups));
    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w + 208) * xd[b]), _mm256_cvtepi32_ps(sum), acc);
  }
  return horizontal_sum(acc);
}
#endif

using RowDot = float (*)(const uint8_t*, const int8_t*, const float*, const int16_t*, int64_t);

template <int64_t QType>
float row_dot_scalar_of(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* xs, int64_t blocks) {
  return row_dot_scalar(QType, w, xq, xd, xs, blocks);
}

#if defined(__AVX2__)
template <int64_t Isa>
RowDot simd_row_dot(int64_t qtype) {
  switch (qtype) {
    case kQ6_K: return row_dot_q6<Isa>;
    case kQ5_K: return row_dot_q45<Isa, true>;
    default: return row_dot_q45<Isa, false>;
  }
}
#endif

RowDot choose_row_dot(int64_t isa, int64_t qtype) {
#if defined(__AVX2__)
  if (isa == kVnni) return simd_row_dot<kVnni>(qtype);
  if (isa == kAvx2) return simd_row_dot<kAvx2>(qtype);
#endif
  switch (qtype) {
    case kQ6_K: return row_dot_scalar_of<kQ6_K>;
    case kQ5_K: return row_dot_scalar_of<kQ5_K>;
    default: return row_dot_scalar_of<kQ4_K>;
  }
}

template <typename T>
void quant_linear_k_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                         const std::optional<at::Tensor>& bias, int64_t isa) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0), blocks = k / kSuper;
  const int64_t row_bytes = weight.size(1);
  SuperRows xq;
  quantize_super_rows<T>(xq, x.data_ptr<T>(), rows, k);
  const RowDot row_dot = choose_row_dot(isa, qtype);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* bias_values = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* y = out.data_ptr<T>();
  // a weight row is read once per tile of x's rows, from L1 after the first
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tile = 0; tile < rows; tile += kTokenTile) {
      const int64_t tile_end = std::min(rows, tile + kTokenTile);
      for (int64_t col = begin; col < end; ++col) {
        const uint8_t* w_row = w + col * row_bytes;
        const float add = bias_values ? bias_values[col] : 0.0f;
        for (int64_t r = tile; r < tile_end; ++r) {
          const float dot = row_dot(w_row, xq.q.data() + r * k, xq.scale.data() + r * blocks,
                                    xq.sums.data() + r * blocks * kGroups, blocks);
          y[r * n + col] = static_cast<T>(dot + add);
        }
      }
    }
  });
}

void quant_linear_k(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                    const std::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "quant_linear_k: x [M, K] contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "quant_linear_k: the weight is uint8 super-blocks [N, K / 256 * block bytes]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kSuper == 0 && weight.size(1) == k / kSuper * super_block_bytes(qtype),
              "quant_linear_k: K must be a multiple of 256 and match the weight's super-blocks");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0) && out.scalar_type() == x.scalar_type(),
              "quant_linear_k: out [M, N] in x's dtype");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "quant_linear_k: bias float32 [N]");
  }
  const int64_t chosen = isa < 0 ? best_isa() : isa;
  TORCH_CHECK(chosen <= best_isa(), "quant_linear_k: kernel path ", isa, " is not compiled in (best ", best_isa(),
              ")");
  if (x.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat) {
    quant_linear_k_impl<float>(out, x, weight, qtype, bias, chosen);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear_k: x float32 or bfloat16");
    quant_linear_k_impl<c10::BFloat16>(out, x, weight, qtype, bias, chosen);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("quant_linear_k(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, int isa) -> ()",
        &quant_linear_k);
}
