// Vector helpers the CPU kernel files share. Included after isa.h (and after <algorithm> and
// <limits>), inside its target region; internal linkage, so that the builds for several
// instruction sets loaded into one process never resolve to each other's copies.
#pragma once
#include "isa.h"

namespace {

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
