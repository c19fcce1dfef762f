// The decoder's element-wise steps, fused: one pass over each row where torch makes several
// (residual add + RMSNorm, neox rotary embedding in place, SiLU-and-mul).
//
// They round where torch's ops do: in bfloat16 every intermediate that torch would store as a
// bfloat16 tensor is rounded to bfloat16 here too (x + residual; the normalized row before the
// weight; silu(gate) before the product; each product of the rotation before their sum), so
// their results equal kernels/reference.py's rounding for rounding. Arithmetic inside a step is
// float32; only RMSNorm's sum of squares adds in another order than torch's mean.
//
// Rows are split between threads (pool.h's parallel_for); inner dims must be contiguous.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "isa.h"
#include "ops.h"
#include "vec_helpers.h"

namespace {

using fVec = at::vec::Vectorized<float>;
using at::BFloat16;
constexpr int64_t kVec = fVec::size();

#if PDSERVE_ISA == 2
// v rounded to bfloat16 by vcvtneps2bf16: nearest even, as at::vec's conversion rounds, except
// that it flushes subnormals to zero and quiets NaNs its own way, so a vector holding either
// takes at::vec's conversion (bit for bit at::vec's everywhere, which is torch's vectorized
// cast). Inline assembly: the kernels' target region leaves AVX512-BF16 out, so that the
// library runs on every AVX-512 CPU; this is called only where cpu_has_avx512_bf16() says the
// CPU has it. 3x fewer instructions than at::vec's.
inline __m256i to_bf16_native(const fVec& v) {
  const __m512 x = v;
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xA1) != 0, 0))  // NaNs, subnormals
    return at::vec::cvtfp32_bf16(x);
  __m256i r;
  asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(x));
  return r;
}
#endif

// kNative: round to bfloat16 with to_bf16_native (AVX512 builds on a CPU with AVX512-BF16)
template <bool kNative>
inline void store(float* p, const fVec& v, int64_t n = kVec) { v.store(p, n); }
template <bool kNative>
inline void store(BFloat16* p, const fVec& v, int64_t n = kVec) {
#if PDSERVE_ISA == 2
  if constexpr (kNative) {
    const __m256i h = to_bf16_native(v);
    if (n == kVec)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    else
      _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), h);
    return;
  }
#endif
  // round to nearest even, as torch's casts
  at::vec::convert_from_float<BFloat16>(v, v).store(p, n);
}

// v as torch would hold it in a tensor of T: rounded to bfloat16 and back, or as is
template <typename T, bool kNative>
inline fVec as_stored(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if PDSERVE_ISA == 2
    if constexpr (kNative) {
      __m512 widened;
      at::vec::cvtbf16_fp32(to_bf16_native(v), widened);
      return widened;
    }
#endif
    return std::get<0>(at::vec::convert_to_float<BFloat16>(
        at::vec::convert_from_float<BFloat16>(v, v)));
  }
}

// e^x; for bfloat16 results at::vec's faster exp_u20 (each of bfloat16's 65536 values gives
// the same silu rounded to bfloat16 as with torch's exp: tests/kernels/test_cpu_elementwise.py)
template <typename T>
inline fVec exp_for(const fVec& x) {
  if constexpr (std::is_same_v<T, float>)
    return x.exp();
  else
    return x.exp_u20();
}

// out = silu(gate) * up, row by row
template <typename T, bool kNative>
void silu_mul_kernel(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  const fVec one(1.f);
  pdserve_pool::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < n; d += kVec) {
        const int64_t w = std::min(kVec, n - d);
        const fVec x = load(g + r * gs + d, w);
        const fVec s = as_stored<T, kNative>(x / (one + exp_for<T>(x.neg())));
        store<kNative>(o + r * os + d, s * load(u + r * us + d, w), w);
      }
    }
  });
}

// residual = x + residual (when add); out = weight * rms_norm(residual), row by row
template <typename T, bool kNative>
void rms_norm_kernel(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                     double eps, bool add, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = add ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = add ? residual.stride(0) : 0, os = out.stride(0);
  pdserve_pool::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + r * xs;
      if (add) {  // residual first, as stored: the norm reads it back
        for (int64_t d = 0; d < n; d += kVec) {
          const int64_t w = std::min(kVec, n - d);
          store<kNative>(rp + r * rs + d, load(src + d, w) + load(rp + r * rs + d, w), w);
        }
        src = rp + r * rs;
      }
      fVec sq(0.f);
      for (int64_t d = 0; d < n; d += kVec) {
        const fVec v = load(src + d, std::min(kVec, n - d));
        sq = at::vec::fmadd(v, v, sq);
      }
      const float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sq);
      const fVec inv(1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps)));
      for (int64_t d = 0; d < n; d += kVec) {
        const int64_t w = std::min(kVec, n - d);
        const fVec normed = as_stored<T, kNative>(load(src + d, w) * inv);
        store<kNative>(o + r * os + d, load(wp + d, w) * normed, w);
      }
    }
  });
}

// x[t, h] = x * cos[t] + rotate_half(x) * sin[t] in place (neox), rotate_half(x) = (-x2, x1)
template <typename T, bool kNative>
void rope_kernel(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t ts = x.stride(0), hs = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  pdserve_pool::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs;
      const T* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * ts + h * hs;
        for (int64_t d = 0; d < half; d += kVec) {
          const int64_t w = std::min(kVec, half - d);
          const fVec x1 = load(row + d, w), x2 = load(row + half + d, w);
          // each product and the sum rounded as torch's separate ops round them
          const fVec lo = as_stored<T, kNative>(x1 * load(c + d, w)) +
                          as_stored<T, kNative>(x2.neg() * load(s + d, w));
          const fVec hi = as_stored<T, kNative>(x2 * load(c + half + d, w)) +
                          as_stored<T, kNative>(x1 * load(s + half + d, w));
          store<kNative>(row + d, lo, w);
          store<kNative>(row + half + d, hi, w);
        }
      }
    }
  });
}

// fn(T{}, kNative) for the tensor's dtype: bfloat16 rounded natively where the CPU can
template <typename Fn>
void dispatch(at::ScalarType dtype, const Fn& fn) {
  if (dtype == at::kFloat) {
    fn(float{}, std::false_type{});
    return;
  }
#if PDSERVE_ISA == 2
  if (cpu_has_avx512_bf16()) {
    fn(BFloat16{}, std::true_type{});
    return;
  }
#endif
  fn(BFloat16{}, std::false_type{});
}

}  // namespace

PDSERVE_ISA_END

namespace PDSERVE_OPS {

void check_rows(const at::Tensor& t, const char* name) {
  PDSERVE_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
                "%s: a CPU [rows, n] tensor with contiguous rows", name);
  PDSERVE_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                "%s: float32 or bfloat16", name);
}

void same_shape(const at::Tensor& a, const at::Tensor& b, const char* name) {
  PDSERVE_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
                "%s: the shape and dtype of the first input", name);
}

void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor out) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_rows(out, "out");
  same_shape(gate, up, "up");
  same_shape(gate, out, "out");
  dispatch(gate.scalar_type(), [&](auto t, auto native) {
    silu_mul_kernel<decltype(t), decltype(native)::value>(gate, up, out);
  });
}

void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  same_shape(x, out, "out");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: [n], contiguous, the dtype of x");
  at::Tensor res;
  if (residual) {
    res = *residual;
    check_rows(res, "residual");
    same_shape(x, res, "residual");
  }
  const bool add = residual.has_value();
  dispatch(x.scalar_type(), [&](auto t, auto native) {
    rms_norm_kernel<decltype(t), decltype(native)::value>(x, res, weight, eps, add, out);
  });
}

void rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x: a CPU [tokens, heads, head_dim] tensor, head_dim even and contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x: float32 or bfloat16");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(2) &&
                    t->stride(1) == 1 && t->scalar_type() == x.scalar_type(),
                "cos, sin: [tokens, head_dim] with contiguous rows, the dtype of x");
  dispatch(x.scalar_type(), [&](auto t, auto native) {
    rope_kernel<decltype(t), decltype(native)::value>(x, cos, sin);
  });
}

}  // namespace PDSERVE_OPS
