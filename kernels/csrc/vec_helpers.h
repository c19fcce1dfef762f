// Vector helpers the CPU kernel files share. Included after isa.h (and after <algorithm> and
// <limits>), inside its target region; internal linkage, so that the builds for several
// instruction sets loaded into one process never resolve to each other's copies.
#pragma once
#include "isa.h"

namespace {

// Whether this CPU has AVX512-BF16 (float <-> bfloat16 pairs in one instruction): the kernels
// that use it are called only where it says so.
inline bool cpu_has_avx512_bf16() {
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu;
}

// n values (default: a whole vector) of a float or bfloat16 row at p as float; zeros past n.
inline at::vec::Vectorized<float> load(const float* p,
                                       int64_t n = at::vec::Vectorized<float>::size()) {
  using fVec = at::vec::Vectorized<float>;
  return n == fVec::size() ? fVec::loadu(p) : fVec::loadu(p, n);
}
inline at::vec::Vectorized<float> load(const at::BFloat16* p,
                                       int64_t n = at::vec::Vectorized<float>::size()) {
  at::vec::Vectorized<float> v;
  if (n == v.size()) {
    at::vec::load_to_float(p, v);
    return v;
  }
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(
      at::vec::Vectorized<at::BFloat16>::loadu(p, n)));
}

// The largest of x[0:n]; -inf for n = 0 or a row masked whole.
inline float row_max(const float* x, int64_t n) {
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t kWidth = fVec::size();
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kWidth) {
    fVec mv = fVec::loadu(x);
    for (i = kWidth; i + kWidth <= n; i += kWidth) mv = at::vec::maximum(mv, fVec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); },
                                       mv);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

}  // namespace
