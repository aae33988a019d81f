// CPU kernels for the decoder's memory-bound steps. Each one computes what its PyTorch
// reference in splitserve/model/ops.py computes (same roundings to the model dtype, in
// the same places), in one pass over memory instead of several ops. Built at first use
// by splitserve/model/native.py with torch.utils.cpp_extension.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Element conversions written with plain integer and float arithmetic so that the
// compiler vectorizes the loops that use them (c10's scalar conversions branch on NaN).
inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // to nearest even
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

// Loads n values of T as float32, and stores float32 values as T (rounded to nearest even).
template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(float* dst, const c10::BFloat16* src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(bits[i]);
}

#if defined(__AVX512F__)
// float16 <-> float32 16 lanes at a time (VCVTPH2PS / VCVTPS2PH, round to nearest even as
// c10's conversion): c10's scalar conversion is bit arithmetic the compiler leaves scalar.
template <>
inline void load_row<c10::Half>(float* dst, const c10::Half* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX512F__)
template <>
inline void store_row<c10::Half>(c10::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), half);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
#endif

template <>
inline void store_row<c10::BFloat16>(c10::BFloat16* dst, const float* src, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16_bits(src[i]);
}

// The reference runs several ops, each rounding its result to the tensor's dtype; the
// fused kernels round at the same points (in place, on float32 values) so that bf16
// results match it bit for bit.
template <typename T>
inline void round_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<T>(x[i]));
}

template <>
inline void round_row<float>(float*, int64_t) {}

template <>
inline void round_row<c10::BFloat16>(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_bits_to_float(float_to_bf16_bits(x[i]));
}

// exp(x) for x in float32 to about 2 ulp (Cephes' expf polynomial), vectorizable, unlike
// std::exp. Rounding x / ln 2 to an integer with the 1.5 * 2^23 trick keeps it branch free.
#pragma omp declare simd
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float shifted = x * 1.44269504088896341f + shifter;
  const float k = shifted - shifter;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const int32_t exponent = (shifted_bits - 0x4B400000) + 127;  // k as an integer, biased
  const int32_t scale_bits = exponent << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// x * rsqrt(mean(x^2) + eps) in float32, cast to T, then times the weight in T (as
// transformers' RMSNorm); x (float32, n values) is overwritten with the T-rounded result.
template <typename T>
inline void rms_normalize(float* x, const float* weight, int64_t n, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  round_row<T>(x, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= weight[i];
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* x_ptr = x.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  std::vector<float> w(n);
  load_row(w.data(), weight.const_data_ptr<T>(), n);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(row.data(), x_ptr + r * x_stride, n);
      rms_normalize<T>(row.data(), w.data(), n, static_cast<float>(eps));
      store_row(out_ptr + r * out_stride, row.data(), n);
    }
  });
}

// residual += delta (rounded to T, as `residual + delta` would be); out = rms_norm(residual).
template <typename T>
void add_rms_norm_impl(at::Tensor& out, at::Tensor& residual, const at::Tensor& delta,
                       const at::Tensor& weight, double eps) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  T* res_ptr = residual.mutable_data_ptr<T>();
  const T* delta_ptr = delta.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  const int64_t res_stride = residual.stride(0), delta_stride = delta.stride(0);
  const int64_t out_stride = out.stride(0);
  std::vector<float> w(n);
  load_row(w.data(), weight.const_data_ptr<T>(), n);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), added(n);
    for (int64_t r = begin; r < end; ++r) {
      T* res = res_ptr + r * res_stride;
      load_row(row.data(), res, n);
      load_row(added.data(), delta_ptr + r * delta_stride, n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] += added[i];
      round_row<T>(row.data(), n);
      store_row(res, row.data(), n);
      rms_normalize<T>(row.data(), w.data(), n, static_cast<float>(eps));
      store_row(out_ptr + r * out_stride, row.data(), n);
    }
  });
}

// out = silu(gate) * up, gate and up the two halves of each row of gate_up.
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  const int64_t in_stride = gate_up.stride(0), out_stride = out.stride(0);
  const T* in_ptr = gate_up.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), up(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gate.data(), in_ptr + r * in_stride, n);
      load_row(up.data(), in_ptr + r * in_stride + n, n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + exp_approx(-gate[i]));
      round_row<T>(gate.data(), n);  // silu's result, in T
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) gate[i] *= up[i];
      store_row(out_ptr + r * out_stride, gate.data(), n);
    }
  });
}

// Each row's index of its largest value, the first one on ties; a NaN beats every number
// (the first NaN), as torch.argmax. ATen's bf16 argmax is a scalar loop: at the decode
// batch and vocabulary sizes it took as long as the model's matmuls.
template <typename T>
void argmax_rows_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* x_ptr = x.const_data_ptr<T>();
  int64_t* out_ptr = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(row.data(), x_ptr + r * stride, n);
      float best = -std::numeric_limits<float>::infinity();
      int32_t nans = 0;
#pragma omp simd reduction(max : best) reduction(+ : nans)
      for (int64_t i = 0; i < n; ++i) {
        best = row[i] > best ? row[i] : best;
        nans += row[i] != row[i];
      }
      int64_t index = 0;
      if (nans > 0) {
        while (row[index] == row[index]) ++index;
      } else {
        while (row[index] != best) ++index;
      }
      out_ptr[r] = index;
    }
  });
}

// In place on each row of qkv = [q heads | k heads | v heads]: optional per-head RMSNorm
// of q and k, rotary embedding of q and k (x * cos + roll(x, D/2) * sin, the sign of
// rotate_half folded into sin's first half), then k and v written to the cache slot, as
// the cache's element type C (float32 activations into a 16-bit cache: rounded to nearest
// even, as torch's conversion; the same type: copied).
template <typename T, typename C>
void rope_and_cache_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& qk_norm_weight, double eps,
                         at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), head_dim = kv_layer.size(-1), half = head_dim / 2;
  const int64_t qkv_stride = qkv.stride(0);
  const int64_t rotated_heads = num_heads + num_kv_heads;
  const int64_t slot_numel = num_kv_heads * head_dim;
  T* qkv_ptr = qkv.mutable_data_ptr<T>();
  const T* cos_ptr = cos.const_data_ptr<T>();
  const T* sin_ptr = sin.const_data_ptr<T>();
  std::vector<float> norm_weight;
  if (qk_norm_weight.has_value()) {
    norm_weight.resize(rotated_heads * head_dim);
    load_row(norm_weight.data(), qk_norm_weight->const_data_ptr<T>(), rotated_heads * head_dim);
  }
  C* key_cache = kv_layer.mutable_data_ptr<C>();
  C* value_cache = key_cache + kv_layer.stride(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> head(head_dim), rolled(head_dim), c(head_dim), s(head_dim);
    std::vector<float> converted(std::is_same_v<T, C> ? 0 : slot_numel);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv_ptr + t * qkv_stride;
      load_row(c.data(), cos_ptr + t * head_dim, head_dim);
      load_row(s.data(), sin_ptr + t * head_dim, head_dim);
      for (int64_t h = 0; h < rotated_heads; ++h) {
        T* x = row + h * head_dim;
        load_row(head.data(), x, head_dim);
        if (!norm_weight.empty()) {
          rms_normalize<T>(head.data(), norm_weight.data() + h * head_dim, head_dim, static_cast<float>(eps));
          round_row<T>(head.data(), head_dim);  // the norm's output, in T
        }
        std::copy_n(head.data() + half, half, rolled.data());
        std::copy_n(head.data(), half, rolled.data() + half);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) head[d] *= c[d];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) rolled[d] *= s[d];
        round_row<T>(head.data(), head_dim);
        round_row<T>(rolled.data(), head_dim);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) head[d] += rolled[d];
        store_row(x, head.data(), head_dim);
      }
      const int64_t slot = slots[t];
      if constexpr (std::is_same_v<T, C>) {
        std::copy_n(row + num_heads * head_dim, slot_numel, key_cache + slot * slot_numel);
        std::copy_n(row + rotated_heads * head_dim, slot_numel, value_cache + slot * slot_numel);
      } else {
        load_row(converted.data(), row + num_heads * head_dim, slot_numel);
        store_row(key_cache + slot * slot_numel, converted.data(), slot_numel);
        load_row(converted.data(), row + rotated_heads * head_dim, slot_numel);
        store_row(value_cache + slot * slot_numel, converted.data(), slot_numel);
      }
    }
  });
}

// Decode attention over the paged cache: one query token per sequence against its
// context, read in place from the cache blocks (no gather, no padding). Work is split
// into (sequence, context partition) items so one long sequence still uses every core;
// partitions of one sequence are merged with their softmax maxima and sums (split-K).
constexpr int64_t kPartition = 256;

struct WorkItem {
  int64_t seq, start, end, partial;  // partial: row in the scratch, or -1 if the only one
};

// One partition's view of the cache: where each of its tokens lives.
template <typename T>
struct PartitionKV {
  const T* key_cache;
  const T* value_cache;
  const int32_t* table;  // the sequence's block table
  int64_t block_size, token_stride, start, end;

  int64_t slot(int64_t pos) const {
    return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  }
};

// Scratch of one thread: per head, the partition's scores, their max and sum of exp, and
// the unnormalised output (float32).
struct PartitionScratch {
  std::vector<float> query, rows, scores, acc, head_max, head_sum;
  PartitionScratch(int64_t num_heads, int64_t head_dim, int64_t token_stride)
      : query(num_heads * head_dim), rows(token_stride), scores(num_heads * kPartition),
        acc(num_heads * head_dim), head_max(num_heads), head_sum(num_heads) {}
};

// scores -> exp(scores - max) in place; records each head's max and sum.
inline void softmax_partition(PartitionScratch& s, int64_t num_heads, int64_t n) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* row = s.scores.data() + h * kPartition;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, row[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      row[t] = exp_approx(row[t] - m);
      sum += row[t];
    }
    s.head_max[h] = m;
    s.head_sum[h] = sum;
  }
}

// Portable partition kernel (any head_dim, any ISA): rows converted to float32, then
// plain loops the compiler vectorizes.
template <typename T>
void attend_partition(const PartitionKV<T>& kv, PartitionScratch& s, int64_t num_heads, int64_t group,
                      int64_t head_dim) {
  const int64_t n = kv.end - kv.start;
  for (int64_t t = 0; t < n; ++t) {
    load_row(s.rows.data(), kv.key_cache + kv.slot(kv.start + t) * kv.token_stride, kv.token_stride);
    for (int64_t h = 0; h < num_heads; ++h) {
      s.scores[h * kPartition + t] =
          dot(s.query.data() + h * head_dim, s.rows.data() + (h / group) * head_dim, head_dim);
    }
  }
  softmax_partition(s, num_heads, n);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    load_row(s.rows.data(), kv.value_cache + kv.slot(kv.start + t) * kv.token_stride, kv.token_stride);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float w = s.scores[h * kPartition + t];
      const float* v = s.rows.data() + (h / group) * head_dim;
      float* a = s.acc.data() + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * v[d];
    }
  }
}

#if defined(__AVX512F__)
// 16 values of T as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// AVX-512 partition kernel for head_dim = 16 * kVecs: a head's key or value row is held in
// kVecs registers and converted once, a head's output accumulates in registers over the
// partition, and tokens are walked block by block (no division per token). The memory
// reads are the same as the portable kernel's; the work per byte is what shrinks.
template <typename T, int kVecs>
void attend_partition_avx512(const PartitionKV<T>& kv, PartitionScratch& s, int64_t num_heads,
                             int64_t group) {
  constexpr int64_t kHeadDim = 16 * kVecs;
  const int64_t n = kv.end - kv.start, num_kv_heads = num_heads / group;
  const float* query = s.query.data();
  for (int64_t pos = kv.start; pos < kv.end;) {
    const int64_t offset = pos % kv.block_size;
    const int64_t run = std::min(kv.block_size - offset, kv.end - pos);
    const T* row = kv.key_cache + kv.slot(pos) * kv.token_stride;
    for (int64_t t = pos - kv.start; t < pos - kv.start + run; ++t, row += kv.token_stride) {
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        __m512 key[kVecs];
        for (int v = 0; v < kVecs; ++v) key[v] = load16(row + g * kHeadDim + 16 * v);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          __m512 sum = _mm512_mul_ps(key[0], _mm512_loadu_ps(query + h * kHeadDim));
          for (int v = 1; v < kVecs; ++v)
            sum = _mm512_fmadd_ps(key[v], _mm512_loadu_ps(query + h * kHeadDim + 16 * v), sum);
          s.scores[h * kPartition + t] = _mm512_reduce_add_ps(sum);
        }
      }
    }
    pos += run;
  }
  softmax_partition(s, num_heads, n);
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t value_offset = (h / group) * kHeadDim;
    const float* weights = s.scores.data() + h * kPartition;
    __m512 acc[kVecs];
    for (int v = 0; v < kVecs; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t pos = kv.start; pos < kv.end;) {
      const int64_t offset = pos % kv.block_size;
      const int64_t run = std::min(kv.block_size - offset, kv.end - pos);
      const T* row = kv.value_cache + kv.slot(pos) * kv.token_stride + value_offset;
      for (int64_t t = pos - kv.start; t < pos - kv.start + run; ++t, row += kv.token_stride) {
        const __m512 w = _mm512_set1_ps(weights[t]);
        for (int v = 0; v < kVecs; ++v) acc[v] = _mm512_fmadd_ps(w, load16(row + 16 * v), acc[v]);
      }
      pos += run;
    }
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(s.acc.data() + h * kHeadDim + 16 * v, acc[v]);
  }
}
#endif

template <typename T>
void attend_partition_dispatch(const PartitionKV<T>& kv, PartitionScratch& s, int64_t num_heads,
                               int64_t group, int64_t head_dim) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {  // float64 keeps the portable kernel
    switch (head_dim) {
      case 32: return attend_partition_avx512<T, 2>(kv, s, num_heads, group);
      case 64: return attend_partition_avx512<T, 4>(kv, s, num_heads, group);
      case 128: return attend_partition_avx512<T, 8>(kv, s, num_heads, group);
      default: break;
    }
  }
#endif
  attend_partition(kv, s, num_heads, group, head_dim);
}

// T: q and out; C: the cache (T, or a 16-bit type under float32 q: every product and sum
// is float32 either way, only the bytes read from the cache shrink).
template <typename T, typename C>
void paged_decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_layer,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                 double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t table_stride = block_tables.stride(0);
  const T* q_ptr = q.const_data_ptr<T>();
  const C* key_cache = kv_layer.const_data_ptr<C>();
  const C* value_cache = key_cache + kv_layer.stride(0);
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  T* out_ptr = out.mutable_data_ptr<T>();

  std::vector<WorkItem> items;
  std::vector<int64_t> first_item(num_seqs + 1);
  int64_t num_partials = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    first_item[b] = static_cast<int64_t>(items.size());
    const int64_t len = lens[b];
    TORCH_CHECK(len > 0, "paged_decode_attention: empty context");
    const bool split = len > kPartition;
    for (int64_t start = 0; start < len; start += kPartition) {
      items.push_back({b, start, std::min(len, start + kPartition), split ? num_partials++ : -1});
    }
  }
  first_item[num_seqs] = static_cast<int64_t>(items.size());
  // per partial item: max and sum of exp per head, then the unnormalised output
  std::vector<float> partial_max(num_partials * num_heads), partial_sum(num_partials * num_heads);
  std::vector<float> partial_out(num_partials * num_heads * head_dim);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    PartitionScratch s(num_heads, head_dim, token_stride);
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem item = items[i];
      load_row(s.query.data(), q_ptr + item.seq * q_stride, num_heads * head_dim);
      for (float& v : s.query) v *= static_cast<float>(scale);
      const PartitionKV<C> kv{key_cache,    value_cache, tables + item.seq * table_stride,
                              block_size,   token_stride, item.start,
                              item.end};
      attend_partition_dispatch(kv, s, num_heads, group, head_dim);
      if (item.partial < 0) {
        for (int64_t h = 0; h < num_heads; ++h) {
          const float inv = 1.0f / s.head_sum[h];
          for (int64_t d = 0; d < head_dim; ++d) s.acc[h * head_dim + d] *= inv;
        }
        store_row(out_ptr + item.seq * out_stride, s.acc.data(), num_heads * head_dim);
      } else {
        std::copy(s.head_max.begin(), s.head_max.end(), partial_max.begin() + item.partial * num_heads);
        std::copy(s.head_sum.begin(), s.head_sum.end(), partial_sum.begin() + item.partial * num_heads);
        std::copy(s.acc.begin(), s.acc.end(), partial_out.begin() + item.partial * num_heads * head_dim);
      }
    }
  });
  if (num_partials == 0) return;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(num_heads * head_dim);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = first_item[b], last = first_item[b + 1];
      if (items[first].partial < 0) continue;
      for (int64_t h = 0; h < num_heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first; i < last; ++i) m = std::max(m, partial_max[items[i].partial * num_heads + h]);
        float total = 0.f;
        float* o = merged.data() + h * head_dim;
        std::fill(o, o + head_dim, 0.f);
        for (int64_t i = first; i < last; ++i) {
          const int64_t p = items[i].partial;
          const float weight = std::exp(partial_max[p * num_heads + h] - m);
          total += weight * partial_sum[p * num_heads + h];
          const float* part = partial_out.data() + (p * num_heads + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * part[d];
        }
        for (int64_t d = 0; d < head_dim; ++d) o[d] /= total;
      }
      store_row(out_ptr + b * out_stride, merged.data(), num_heads * head_dim);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// A cache of another dtype than the activations: only float32 activations over a 16-bit
// cache (engine/device.py choose_kv_cache_dtype allows no other mix).
void check_mixed_cache(const at::Tensor& activations, const at::Tensor& kv_layer, const char* op) {
  TORCH_CHECK(activations.scalar_type() == at::kFloat &&
                  (kv_layer.scalar_type() == at::kBFloat16 || kv_layer.scalar_type() == at::kHalf),
              op, ": a KV cache of another dtype than the activations must be bfloat16 or float16 "
              "under float32 activations, not ", kv_layer.scalar_type(), " under ", activations.scalar_type());
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must match x's rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(out, x, weight, eps); });
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& delta, const at::Tensor& weight,
                  double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "weight must match rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm",
                                  [&] { add_rms_norm_impl<scalar_t>(out, residual, delta, weight, eps); });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1), "gate_up must be twice as wide as out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(out, gate_up); });
}

void argmax_rows(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == x.size(0),
              "out: int64, one per row");
  TORCH_CHECK(x.size(1) > 0, "argmax of empty rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows",
                                  [&] { argmax_rows_impl<scalar_t>(out, x); });
}

void rope_and_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                    const std::optional<at::Tensor>& qk_norm_weight, double eps, at::Tensor kv_layer,
                    const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.dim() == 5, "kv_layer must be [2, blocks, block, heads, dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * kv_layer.size(-1), "qkv width");
  if (kv_layer.scalar_type() == qkv.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache", [&] {
      rope_and_cache_impl<scalar_t, scalar_t>(qkv, cos, sin, qk_norm_weight, eps, kv_layer, slot_mapping,
                                              num_heads, num_kv_heads);
    });
    return;
  }
  check_mixed_cache(qkv, kv_layer, "rope_and_cache");
  if (kv_layer.scalar_type() == at::kBFloat16) {
    rope_and_cache_impl<float, c10::BFloat16>(qkv, cos, sin, qk_norm_weight, eps, kv_layer, slot_mapping,
                                              num_heads, num_kv_heads);
  } else {
    rope_and_cache_impl<float, c10::Half>(qkv, cos, sin, qk_norm_weight, eps, kv_layer, slot_mapping,
                                          num_heads, num_kv_heads);
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_layer,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [seqs, heads, dim]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.dim() == 5, "kv_layer must be [2, blocks, block, heads, dim]");
  TORCH_CHECK(q.size(1) % kv_layer.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32 rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: int32");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have q's dtype");
  if (kv_layer.scalar_type() == q.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      paged_decode_attention_impl<scalar_t, scalar_t>(out, q, kv_layer, block_tables, context_lens, scale);
    });
    return;
  }
  check_mixed_cache(q, kv_layer, "paged_decode_attention");
  if (kv_layer.scalar_type() == at::kBFloat16) {
    paged_decode_attention_impl<float, c10::BFloat16>(out, q, kv_layer, block_tables, context_lens, scale);
  } else {
    paged_decode_attention_impl<float, c10::Half>(out, q, kv_layer, block_tables, context_lens, scale);
  }
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor delta, Tensor weight, float eps) -> ()",
        &add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()", &silu_and_mul);
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()", &argmax_rows);
  m.def(
      "rope_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor? qk_norm_weight, float eps, "
      "Tensor(b!) kv_layer, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()",
      &rope_and_cache);
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_layer, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()",
      &paged_decode_attention);
}
