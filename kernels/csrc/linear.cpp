// Float32 linear layers over weights packed once into panels: y = x W^T (+ bias), W [n, k].
//
// The weight of n outputs is stored as ceil(n / kPanel) panels, each [k][kPanel]: the weights of
// kPanel consecutive outputs side by side, position by position (zeros past n). A step reads
// each panel front to back once for up to kRows rows of x, keeping kRows x kPanel sums in
// registers (12 vectors: 6 rows of two vectors); rows past kRows read the panel again, from the
// cache. So a decode step's few rows stream the weights near the core's read bandwidth, and a
// prompt's many rows run at its multiply rate. On 2 AVX2 cores (Zen 1, float32, the 56M-parameter
// benchmark model's linears; benchmarks/linears.py, results/avx2_zen1/linears.txt) a forward's
// linears took 0.80-0.84x the time of oneDNN's packed GEMM at 1-16 rows on one thread (0.74-0.86x
// on two), 0.94-0.97x at 32-64 rows and 1.00-1.01x at 256-1024.
//
// Each output is one chain of fused multiply-adds in position order, whatever the rows beside
// it, the thread count or the row's place in the step: a row's result is the same bit for bit
// in every batch (oneDNN picks its kernels, and so its sums' order, by the row count).
//
// Panels are split between threads (pool.h's parallel_for); rows go in chunks of kChunk, so that a
// chunk of a long prompt's rows stays in the cache while every panel passes over it.
#include <ATen/ops/empty.h>

#include <algorithm>

#include "isa.h"
#include "ops.h"

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();
constexpr int64_t kPanel = 2 * kVec;  // outputs per panel: two vectors
constexpr int64_t kRows = 6;          // rows per pass over a panel: 12 sums in registers
constexpr int64_t kChunk = 96;        // rows per chunk

constexpr int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// rows [0, R) of x (row stride ldx) times one panel of k positions -> y (row stride ldy), its
// first `cols` outputs. The sums are named variables: an array of them was kept on the stack.
template <int R>
inline void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                       int64_t ldy, int64_t cols) {
  fVec c00(0.f), c01(0.f), c10(0.f), c11(0.f), c20(0.f), c21(0.f), c30(0.f), c31(0.f),
      c40(0.f), c41(0.f), c50(0.f), c51(0.f);
  for (int64_t i = 0; i < k; ++i) {
    const fVec w0 = fVec::loadu(panel + i * kPanel), w1 = fVec::loadu(panel + i * kPanel + kVec);
#define PDSERVE_ROW(r)                         \
  if constexpr (R > r) {                       \
    const fVec b(x[r * ldx + i]);              \
    c##r##0 = at::vec::fmadd(b, w0, c##r##0);  \
    c##r##1 = at::vec::fmadd(b, w1, c##r##1);  \
  }
    PDSERVE_ROW(0) PDSERVE_ROW(1) PDSERVE_ROW(2) PDSERVE_ROW(3) PDSERVE_ROW(4) PDSERVE_ROW(5)
#undef PDSERVE_ROW
  }
  const fVec sums[kRows][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    if (cols == kPanel) {
      sums[r][0].store(out);
      sums[r][1].store(out + kVec);
    } else {
      sums[r][0].store(out, std::min(cols, kVec));
      if (cols > kVec) sums[r][1].store(out + kVec, cols - kVec);
    }
  }
}

using PanelRows = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                           int64_t);
constexpr PanelRows kPanelRows[kRows + 1] = {nullptr,          panel_rows<1>, panel_rows<2>,
                                             panel_rows<3>,    panel_rows<4>, panel_rows<5>,
                                             panel_rows<6>};

void linear_kernel(const float* x, int64_t m, int64_t ldx, const float* packed, int64_t k,
                   int64_t n, const float* bias, float* y, int64_t ldy) {
  const int64_t panels = num_panels(n);
  for (int64_t m0 = 0; m0 < m; m0 += kChunk) {
    const int64_t m1 = std::min(m, m0 + kChunk);
    pdserve_pool::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        for (int64_t r = m0; r < m1; r += kRows) {
          const int64_t rows = std::min(kRows, m1 - r);
          kPanelRows[rows](x + r * ldx, ldx, packed + p * k * kPanel, k, y + r * ldy + col, ldy,
                           cols);
          if (bias)
            for (int64_t i = r; i < r + rows; ++i)
              for (int64_t j = 0; j < cols; ++j) y[i * ldy + col + j] += bias[col + j];
        }
      }
    });
  }
}

void pack_kernel(const float* w, int64_t n, int64_t k, float* packed) {
  const int64_t panels = num_panels(n);
  pdserve_pool::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* panel = packed + p * k * kPanel;
      std::fill(panel, panel + k * kPanel, 0.f);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const float* row = w + (p * kPanel + j) * k;
        for (int64_t i = 0; i < k; ++i) panel[i * kPanel + j] = row[i];
      }
    }
  });
}

}  // namespace

PDSERVE_ISA_END

namespace PDSERVE_OPS {

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  PDSERVE_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                    weight.scalar_type() == at::kFloat,
                "weight: a CPU float32 [out_features, in_features] tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor packed = at::empty({num_panels(n), k, kPanel}, w.options());
  pack_kernel(w.data_ptr<float>(), n, k, packed.data_ptr<float>());
  return packed;
}

void packed_linear(const at::Tensor& x, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias, at::Tensor out) {
  PDSERVE_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kPanel &&
                    packed.scalar_type() == at::kFloat && packed.is_contiguous(),
                "packed: a weight from this build's pack_linear_weight ([panels, k, %d])",
                static_cast<int>(kPanel));
  const int64_t k = packed.size(1);
  PDSERVE_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                    x.scalar_type() == at::kFloat,
                "x: a CPU float32 [rows, %lld] tensor with contiguous rows",
                static_cast<long long>(k));
  const int64_t n = out.size(-1);
  PDSERVE_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == x.size(0) &&
                    out.stride(1) == 1 && out.scalar_type() == at::kFloat &&
                    num_panels(n) == packed.size(0),
                "out: a CPU float32 [rows, out_features] tensor with contiguous rows, its "
                "width that of the packed weight");
  const float* b = nullptr;
  if (bias) {
    PDSERVE_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == n &&
                      bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                  "bias: a contiguous CPU float32 [out_features] tensor");
    b = bias->data_ptr<float>();
  }
  if (x.size(0) == 0) return;
  linear_kernel(x.data_ptr<float>(), x.size(0), x.stride(0), packed.data_ptr<float>(), k, n, b,
                out.data_ptr<float>(), out.stride(0));
}

}  // namespace PDSERVE_OPS
