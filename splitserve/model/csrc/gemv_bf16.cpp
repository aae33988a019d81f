// y = x W^T + b for bf16 x [M, K] with few rows (a decode step) and a plain row-major bf16
// weight [N, K], on CPUs with AVX512-BF16.
//
// At M = 1 a matmul reads each weight once and does two flops per two bytes read: it is
// bound by memory bandwidth, and oneDNN's bf16 path reaches ~18 GB/s of this machine's ~31
// (2 cores). This kernel streams the weight rows as they lie: VDPBF16PS multiplies 32 bf16
// of a weight row by the same 32 of x (the pairs along K are exactly the instruction's
// pair layout, so no repacking) and adds the products into 16 float32 lanes. Each thread
// owns a contiguous range of output rows, so it reads one contiguous stretch of memory, 4
// rows at a time (4 independent accumulator chains); x stays in L1. The 4 rows' next 64
// bytes are prefetched one group ahead. For M > 1 the group of 4 weight rows (a few KB, in
// L1 after the first pass) is multiplied by x in tiles of up to 4 rows, so the weight is
// still read from memory once. Accumulation is float32 (each lane a chain of fused pair
// products, then a tree over the 16 lanes), the bias added in float32, then one rounding
// to bf16, as F.linear rounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)

constexpr int64_t kRowGroup = 4;  // weight rows streamed together: 4 accumulator chains per x row
constexpr int64_t kXTile = 4;     // rows of x per pass over a weight group: 16 accumulators at most
constexpr int64_t kChunk = 32;    // bf16 values per 512-bit load: one VDPBF16PS
// a thread's share is at least this many bytes of weight: smaller matmuls are not split
constexpr int64_t kMinBytesPerThread = 32 * 1024;

// sums[m * R + r] = dot(x row m, weight row r) in float32, for M x rows and R weight rows.
// A K that is not a multiple of 32 ends with masked loads (zeros beyond K on both sides).
template <int M, int R>
inline void dot_tile(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* w, int64_t k,
                     bool prefetch_next, float* sums) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  // the next group's rows start R * k values on: prefetching them as this group is read
  // keeps more of the stream in flight than the hardware prefetcher alone does
  const int64_t ahead = R * k;
  int64_t c = 0;
  for (; c + kChunk <= k; c += kChunk) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * k + c);
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + r * k + c), _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + c);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (c < k) {
    const __mmask32 mask = _bzhi_u32(0xffffffffu, static_cast<unsigned>(k - c));
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + c);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + c);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) sums[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// out rows [m0, m0 + M) x columns [n0, n0 + R): the group's dot products, bias, one rounding
template <int M, int R>
inline void group_tile(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                       const c10::BFloat16* bias, int64_t n, int64_t k, int64_t m0, int64_t n0,
                       bool prefetch_next) {
  float sums[M * R];
  dot_tile<M, R>(x + m0 * k, k, w + n0 * k, k, prefetch_next, sums);
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      const float add = bias ? static_cast<float>(bias[n0 + r]) : 0.0f;
      out[(m0 + m) * n + n0 + r] = c10::BFloat16(sums[m * R + r] + add);
    }
  }
}

template <int R>
void group_all_rows(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                    const c10::BFloat16* bias, int64_t rows, int64_t n, int64_t k, int64_t n0,
                    bool prefetch_next) {
  int64_t m0 = 0;
  // only the first x tile prefetches: later tiles find the group in L1
  for (; m0 + kXTile <= rows; m0 += kXTile) {
    group_tile<kXTile, R>(out, x, w, bias, n, k, m0, n0, prefetch_next && m0 == 0);
  }
  const bool first = prefetch_next && m0 == 0;
  switch (rows - m0) {
    case 1: group_tile<1, R>(out, x, w, bias, n, k, m0, n0, first); break;
    case 2: group_tile<2, R>(out, x, w, bias, n, k, m0, n0, first); break;
    case 3: group_tile<3, R>(out, x, w, bias, n, k, m0, n0, first); break;
    default: break;
  }
}

void gemv_bf16_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* w = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
  const int64_t full_groups = n / kRowGroup;
  const int64_t group_bytes = kRowGroup * k * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / group_bytes);
  // each thread a contiguous range of whole groups: one contiguous stretch of the weight
  at::parallel_for(0, full_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      // no prefetch past the thread's range (another thread reads it, or it is not there)
      group_all_rows<kRowGroup>(y, xp, w, b, rows, n, k, g * kRowGroup, g + 1 < end);
    }
  });
  // the last N % 4 rows, one at a time (a few hundred bytes: not worth a thread)
  for (int64_t col = full_groups * kRowGroup; col < n; ++col) {
    group_all_rows<1>(y, xp, w, b, rows, n, k, col, false);
  }
}

#endif  // __AVX512BF16__

bool gemv_bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void gemv_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(gemv_bf16_supported(), "gemv_bf16: not built for this CPU (needs AVX512-BF16)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "gemv_bf16: x, weight and out bf16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gemv_bf16: x [M, K] contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "gemv_bf16: weight [N, K] contiguous");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "gemv_bf16: out [M, N] contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == weight.size(0),
                "gemv_bf16: bias bf16 [N]");
  }
  if (x.size(0) == 0 || weight.size(0) == 0) return;
#if defined(__AVX512BF16__)
  gemv_bf16_impl(out, x, weight, bias);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("gemv_bf16_supported() -> bool", &gemv_bf16_supported);
  m.def("gemv_bf16(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()", &gemv_bf16);
}
