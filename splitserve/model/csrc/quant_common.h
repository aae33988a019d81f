// What quant_matmul.cpp and quant_matmul_k.cpp share: the kernel paths, how rows of x are
// tiled, and the fp16 conversion of the blocks' scales.
#pragma once

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace splitserve_quant {

// the kernel paths, best first; `isa` -1 asks for the best one compiled in
constexpr int64_t kScalar = 0;
constexpr int64_t kAvx2 = 1;
constexpr int64_t kVnni = 2;
constexpr int64_t kTokenTile = 32;  // rows of x per pass over a weight row kept in L1

inline int64_t best_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return kVnni;
#elif defined(__AVX2__)
  return kAvx2;
#else
  return kScalar;
#endif
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10's portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

}  // namespace splitserve_quant
