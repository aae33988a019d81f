// Causal prefill attention for bf16 on CPUs with AVX512-BF16: a prefill chunk's queries
// against every key of their sequence, read from the paged cache (the chunk's own keys
// included, already written there), without a mask tensor or a gather.
//
// ATen's CPU flash attention reaches ~50 GFLOP/s on bf16 here, a seventh of what the same
// cores give a bf16 matmul, and it needs a materialised mask for a chunk that starts
// after a cached prefix. This kernel is a flash attention built on VDPBF16PS (two bf16
// products summed into each float32 lane): scores and the running softmax in float32,
// the softmax weights rounded to bf16 for the weighted sum of values (as FlashAttention
// does on GPUs). Keys and values are first repacked, per KV head, into the pair layout
// that instruction reads; each tile of query rows then streams them block by block.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)

constexpr int64_t kKeys = 16;  // keys per block: one float32 lane each in a score vector

// exp(x) on 16 lanes (Cephes' expf polynomial, ~2 ulp), x clamped to float32's range.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

inline uint32_t bf16_pair(uint16_t low, uint16_t high) {
  return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
}

// Keys and values of one KV head, in the layouts VDPBF16PS reads, per block of 16 keys:
//   keys:   [head_dim / 2][16 keys]  pairs (k[2i], k[2i+1]) of one key;
//   values: [8 key pairs][head_dim]  pairs (v_key0[d], v_key1[d]) of two keys.
// Keys past the context are zero (their scores are masked, their weights are zero).
struct PackedKV {
  std::vector<uint32_t> keys, values;  // [kv_heads][blocks][head_dim / 2 * 16]
  int64_t blocks, block_words;
};

PackedKV pack_kv(const uint16_t* key_cache, const uint16_t* value_cache, const int32_t* table,
                 int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t context) {
  PackedKV packed;
  packed.blocks = (context + kKeys - 1) / kKeys;
  packed.block_words = head_dim / 2 * kKeys;
  const int64_t words = num_kv_heads * packed.blocks * packed.block_words;
  packed.keys.assign(words, 0);
  packed.values.assign(words, 0);
  const int64_t token_stride = num_kv_heads * head_dim;
  at::parallel_for(0, num_kv_heads * packed.blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / packed.blocks, b = item % packed.blocks;
      uint32_t* keys = packed.keys.data() + item * packed.block_words;
      uint32_t* values = packed.values.data() + item * packed.block_words;
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t pos = b * kKeys + j;
        if (pos >= context) break;
        const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        const uint16_t* k = key_cache + slot * token_stride + g * head_dim;
        const uint16_t* v = value_cache + slot * token_stride + g * head_dim;
        for (int64_t i = 0; i < head_dim / 2; ++i) keys[i * kKeys + j] = bf16_pair(k[2 * i], k[2 * i + 1]);
        uint16_t* value_halves = reinterpret_cast<uint16_t*>(values + (j / 2) * head_dim);
        for (int64_t d = 0; d < head_dim; ++d) value_halves[2 * d + (j % 2)] = v[d];
      }
    }
  });
  return packed;
}

// kRows query rows (of one KV head's group) against keys [0, limit of each row]: scores in
// registers, online softmax, kRows x head_dim float32 accumulators in registers. kVecs =
// head_dim / 16 and kRows * kVecs = 16 accumulators.
template <int kVecs, int kRows>
void attend_rows(const uint16_t* const* query_rows, const int64_t* limits, const uint32_t* keys,
                 const uint32_t* values, int64_t block_words, float scale, c10::BFloat16* const* out_rows) {
  constexpr int64_t kHeadDim = 16 * kVecs;
  int64_t last = 0;
  for (int r = 0; r < kRows; ++r) last = std::max(last, limits[r]);
  const int64_t num_blocks = last / kKeys + 1;
  __m512 acc[kRows][kVecs];
  float row_max[kRows], row_sum[kRows];
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint32_t* key_block = keys + b * block_words;
    const uint32_t* value_block = values + b * block_words;
    __m512 scores[kRows];
    for (int r = 0; r < kRows; ++r) scores[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kHeadDim / 2; ++i) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(key_block + i * kKeys);
      for (int r = 0; r < kRows; ++r) {
        uint32_t pair;
        std::memcpy(&pair, query_rows[r] + 2 * i, sizeof(pair));
        scores[r] = _mm512_dpbf16_ps(scores[r], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)), k);
      }
    }
    uint32_t weight_pairs[kRows][kKeys / 2];
    for (int r = 0; r < kRows; ++r) {
      const __mmask16 visible = _mm512_cmple_epi32_mask(
          _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys))),
          _mm512_set1_epi32(static_cast<int32_t>(limits[r])));
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), visible,
                                          scores[r], _mm512_set1_ps(scale));
      const float block_max = _mm512_reduce_max_ps(s);
      const float new_max = std::max(row_max[r], block_max);
      // a block wholly past this row's limit changes nothing (new_max stays finite: the
      // first block always holds key 0)
      const float rescale = std::exp(row_max[r] - new_max);
      const __m512 p = _mm512_maskz_mov_ps(visible, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(p);
      row_max[r] = new_max;
      const __m512 factor = _mm512_set1_ps(rescale);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], factor);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight_pairs[r]), (__m256i)_mm512_cvtneps_pbh(p));
    }
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      __m512bh v[kVecs];
      for (int c = 0; c < kVecs; ++c) v[c] = (__m512bh)_mm512_loadu_si512(value_block + j * kHeadDim + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weight_pairs[r][j]));
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if (out_rows[r] == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
    for (int c = 0; c < kVecs; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r] + 16 * c), (__m256i)rounded);
    }
  }
}

template <int kVecs>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_layer,
                            const at::Tensor& block_table, int64_t position_start, double scale) {
  constexpr int kRows = 16 / kVecs;
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const auto* cache = reinterpret_cast<const uint16_t*>(kv_layer.const_data_ptr<c10::BFloat16>());
  const PackedKV packed = pack_kv(cache, cache + kv_layer.stride(0), block_table.const_data_ptr<int32_t>(),
                                  block_size, num_kv_heads, head_dim, position_start + num_tokens);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.const_data_ptr<c10::BFloat16>());
  auto* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  // rows of one KV head: (token, head of the group), token-major, so a tile's rows end
  // their keys at neighbouring positions
  const int64_t rows_per_kv_head = num_tokens * group;
  const int64_t tiles_per_kv_head = (rows_per_kv_head + kRows - 1) / kRows;
  const int64_t num_tiles = num_kv_heads * tiles_per_kv_head;
  // causal: late tiles cost more; handing tiles out longest first, in turns, keeps the
  // threads even
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t order = worker; order < num_tiles; order += threads) {
        const int64_t g = order % num_kv_heads;
        const int64_t tile = tiles_per_kv_head - 1 - order / num_kv_heads;
        const uint16_t* query_rows[kRows];
        c10::BFloat16* out_rows[kRows];
        int64_t limits[kRows];
        for (int r = 0; r < kRows; ++r) {
          const int64_t row = std::min(tile * kRows + r, rows_per_kv_head - 1);
          const int64_t token = row / group, head = g * group + row % group;
          query_rows[r] = q_ptr + token * q_stride + head * head_dim;
          out_rows[r] = tile * kRows + r < rows_per_kv_head ? out_ptr + token * out_stride + head * head_dim
                                                            : nullptr;  // padding row: computed, not stored
          limits[r] = position_start + token;
        }
        attend_rows<kVecs, kRows>(query_rows, limits, packed.keys.data() + g * packed.blocks * packed.block_words,
                                  packed.values.data() + g * packed.blocks * packed.block_words,
                                  packed.block_words, static_cast<float>(scale), out_rows);
      }
    }
  });
}

#endif  // __AVX512BF16__

bool prefill_attention_supported(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_layer,
                       const at::Tensor& block_table, int64_t position_start, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_layer.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, dim]");
  TORCH_CHECK(out.dim() == 3 && out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == q.size(2),
              "out must be shaped like q");
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.dim() == 5, "kv_layer must be [2, blocks, block, heads, dim]");
  TORCH_CHECK(q.size(1) % kv_layer.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table: int32");
  const int64_t context = position_start + q.size(0);
  TORCH_CHECK(block_table.numel() * kv_layer.size(2) >= context, "block_table too short for the context");
  TORCH_CHECK(prefill_attention_supported(q.size(2)), "prefill_attention: unsupported head_dim or CPU");
#if defined(__AVX512BF16__)
  switch (q.size(2)) {
    case 16: return prefill_attention_impl<1>(out, q, kv_layer, block_table, position_start, scale);
    case 32: return prefill_attention_impl<2>(out, q, kv_layer, block_table, position_start, scale);
    case 64: return prefill_attention_impl<4>(out, q, kv_layer, block_table, position_start, scale);
    default: return prefill_attention_impl<8>(out, q, kv_layer, block_table, position_start, scale);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("prefill_attention_supported(int head_dim) -> bool", &prefill_attention_supported);
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_layer, Tensor block_table, int position_start, "
      "float scale) -> ()",
      &prefill_attention);
}
