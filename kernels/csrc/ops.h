// The ops' entry points, checked and dispatched to the kernels of this build's instruction set;
// registered with the dispatcher in registration.cpp, the one file of a build that includes
// torch/library.h (about 10 s of compiling on its own). They live in the build's op namespace,
// so two builds loaded side by side keep their own.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdio>
#include <optional>

// TORCH_CHECK with a printf message: formatted here into a buffer and handed on as one C string.
// TORCH_CHECK's own formatting of several arguments builds an ostringstream in this library,
// and on one machine (Ubuntu 24.04's g++ 13.3 with torch 2.11.0+cu130) every such failed check
// killed the process with SIGSEGV instead of raising, while single-string messages raised. So
// every check of these kernels passes TORCH_CHECK one string (tests/kernels/test_checks.py).
#define PDSERVE_CHECK(cond, ...)                                             \
  do {                                                                       \
    if (C10_UNLIKELY(!(cond))) {                                             \
      char pdserve_message_[512];                                            \
      std::snprintf(pdserve_message_, sizeof(pdserve_message_), __VA_ARGS__); \
      TORCH_CHECK(false, static_cast<const char*>(pdserve_message_));        \
    }                                                                        \
  } while (0)

#ifndef PDSERVE_OPS
#define PDSERVE_OPS pdserve_cpu
#endif

namespace PDSERVE_OPS {

// paged_attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, at::Tensor out);
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& num_cached, double scale, int64_t gemm,
                             at::Tensor out);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping);
// sampling.cpp
void exponential_race(const at::Tensor& probs, const at::Tensor& keys, bool logits,
                      const std::optional<at::Tensor>& cut, at::Tensor out);
void argmax_rows(const at::Tensor& x, at::Tensor out);
void divide_rows(const at::Tensor& x, const at::Tensor& d, at::Tensor out);
// elementwise.cpp
void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor out);
void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps, at::Tensor out);
void rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
// linear.cpp
at::Tensor pack_linear_weight(const at::Tensor& weight);
void packed_linear(const at::Tensor& x, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias, at::Tensor out);
// pool.cpp: the kernels' own threads (pool.h); 0: off, OpenMP's
void set_pool_threads(int64_t n);
int64_t pool_threads();

}  // namespace PDSERVE_OPS
