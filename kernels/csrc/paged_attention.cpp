// Paged attention on the CPU, reading keys and values where they lie in the paged cache.
//
// The cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim] (0 keys, 1
// values); position p of a sequence lives in row block_table[p / block_size], slot
// p % block_size. Both ops accumulate in float32 whatever the cache's dtype (float32, bfloat16)
// and share each key and value row between the query heads of its group (GQA, no repeat).
//
// decode:  one query per sequence. Work items are (sequence, partition of at most kPartition
//          positions), split between threads by cost (positions), so one long sequence among
//          short ones keeps every thread busy; a sequence with several partitions is merged
//          after (flash-decoding). A position's keys for every kv head are one contiguous row:
//          rows are read whole, once each, where they lie (bfloat16 widened to float in
//          registers, or multiplied as bfloat16 pairs where the CPU has AVX512-BF16),
//          prefetched into L2 a fixed number of bytes ahead (the blocks jump): scores for the
//          whole partition, kVec positions summed at once, softmax, then the weighted sum of
//          the value rows kVec at a time with the heads' accumulators in registers (on
//          AVX512-BF16, two value rows at a time as bfloat16 pairs against the weights rounded
//          to bfloat16, as HuggingFace's eager attention rounds its probabilities).
// prefill: a chunk of queries per sequence over its cached prefix and itself (the chunk's keys
//          are already written to the cache), causal. Work items are (sequence, kv head, tile
//          of query tokens); the tile's G heads are packed into one [tokens * G, head_dim]
//          matrix and walk the keys in tiles packed from the blocks into a buffer that stays
//          in cache, scores and values through BLAS GEMMs, online softmax between (the
//          portable build). On AVX-512 and AVX2 the kernel's own products instead of GEMMs,
//          with the query rows in the vector lanes: float32 FMAs (prefill_kernel_lanes;
//          bfloat16 tiles widened to float), and bfloat16 dot products on AVX512-BF16 without
//          AMX (prefill_kernel_dp). bfloat16 with AMX keeps the packed tiles and MKL's bf16
//          GEMM.
//
// Built once per instruction set (kernels/cpu_attention.py picks the one the CPU runs):
// PDSERVE_ISA 2 = AVX512, 1 = AVX2, 0 = portable. Only the kernels below are compiled for it
// (a target pragma, and at::vec's CPU_CAPABILITY namespace): the library's load-time code stays
// baseline, so any build loads on any x86 CPU and only calling a kernel needs its instructions.
// The op namespace comes from PDSERVE_OPS, so that two builds can be loaded side by side.
#include <ATen/ops/from_blob.h>
#include <dlfcn.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "ops.h"
#include "vec_helpers.h"

namespace {

using fVec = at::vec::Vectorized<float>;
using at::BFloat16;
constexpr int64_t kVec = fVec::size();
// decode positions per work item, whatever the batch and the thread count: a sequence's result
// then depends on its own positions only (the same bits in any batch, on any number of threads),
// so a seeded request draws the same tokens however the steps around it are composed
constexpr int64_t kPartition = 512;
#ifndef PDSERVE_AHEAD
#define PDSERVE_AHEAD 16384
#endif
#ifndef PDSERVE_AHEAD_BF16
#define PDSERVE_AHEAD_BF16 12288
#endif
// decode: bytes of rows prefetched ahead of use. bfloat16 rows (half a float one) ran faster
// 12 KiB ahead than 16 on the Zen 4 machine: 1.00-1.27x over 4 x 21 reps of the benchmark's
// decode cases on one and two threads (8 KiB: 0.96-1.09x).
constexpr int64_t kAheadBytes = PDSERVE_AHEAD, kAheadBytesBf16 = PDSERVE_AHEAD_BF16;
constexpr int64_t kQueryRows = 128;      // prefill: query rows (tokens x group heads) per tile
// ... and, in the GEMM kernel (prefill_kernel), per tile of a chunk over a cached prefix of at
// least kLongPrefix positions: every query tile packs every key tile it sees, so taller tiles
// pack a long prefix half as often (1.09-1.19x on one AVX2 thread for 256 to 2048 tokens over
// 2048 to 8192 cached, 1.04-1.06x on two, when AVX2 took the GEMMs; over shorter prefixes they
// lose: 0.72x for a 128-token prompt, 0.96x for 512). The lanes kernels keep one height: the
// bfloat16 dot products kQueryRows (taller tiles there ran 0.94-0.97x on one Zen 4 thread for
// 952-2048 tokens over 2048-4096 cached), the float32 lanes kernel kLanesRows.
constexpr int64_t kQueryRowsLong = 256;
constexpr int64_t kLongPrefix = 2048;
constexpr int64_t kKeyTile = 256;        // prefill: keys per packed tile (rounded to blocks)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- vector helpers (and load, vec_helpers.h): rows of the cache's dtype, as float ----

// `dst[0:n] = float(src[0:n])`; for float rows there is nothing to convert.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) load(src + d).store(dst + d);
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  return dst;
}

inline void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void store(BFloat16* dst, const float* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<BFloat16>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + 2 * kVec <= n; d += 2 * kVec) {
    acc0 = at::vec::fmadd(fVec::loadu(a + d), fVec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(fVec::loadu(a + d + kVec), fVec::loadu(b + d + kVec), acc1);
  }
  for (; d + kVec <= n; d += kVec) acc0 = at::vec::fmadd(fVec::loadu(a + d), fVec::loadu(b + d), acc0);
  float s = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, acc0 + acc1);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// acc[0:n] += w * x[0:n]
inline void axpy(float* acc, float w, const float* x, int64_t n) {
  const fVec wv(w);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec)
    at::vec::fmadd(wv, fVec::loadu(x + d), fVec::loadu(acc + d)).store(acc + d);
  for (; d < n; ++d) acc[d] += w * x[d];
}

// Asks for the cache lines of [p, p + bytes) ahead of their use, into L2 (prefetcht1): L1's
// miss buffers hold too few lines to cover memory latency at the decode's read rate; asked into
// L2, 16 KiB of rows ahead ran 1.4x (float32) to 1.6x (bfloat16) faster on 64 x 2000 positions.
inline void prefetch(const void* p, int64_t bytes) {
  const char* b = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(b + off, 0, 2);
}

// A decode position's key row and its value row, asked for together while the keys are read:
// the value pass after the softmax then finds them nearer than memory (1.04-1.10x on one AVX2
// thread, float32, the attention benchmark's decode cases). The key pass asks for them one kv
// head's part at a time, beside that head's products, rather than whole rows at once (a burst
// of prefetches stalls the loads behind it: 0.94-1.24x, 21 of 24 cases >= 1.00 on a Zen 4).
template <typename T>
inline void prefetch_kv(const T* key_row, int64_t value_offset, int64_t bytes) {
  prefetch(key_row, bytes);
  prefetch(key_row + value_offset, bytes);
}

// Lane i of the result: the sum of the lanes of vector i of v (kVec vectors of kVec floats,
// one after the other): the scores of kVec positions at once, instead of one horizontal
// reduction per position.
#if PDSERVE_ISA != 0
inline __m256 lane_sums8(const __m256* h) {
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#if PDSERVE_ISA == 2
inline fVec lane_sums(const float* v) {
  __m256 h[16];
  for (int i = 0; i < 16; ++i) {  // halves first: 16 vectors of 8
    const __m512 x = _mm512_loadu_ps(v + 16 * i);
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(
      lane_sums8(h))), _mm256_castps_pd(lane_sums8(h + 8)), 1));
}
#elif PDSERVE_ISA == 1
inline fVec lane_sums(const float* v) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i) h[i] = _mm256_loadu_ps(v + 8 * i);
  return lane_sums8(h);
}
#else
inline fVec lane_sums(const float* v) {
  float s[kVec];
  for (int64_t i = 0; i < kVec; ++i)
    s[i] = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; },
                                          fVec::loadu(v + kVec * i));
  return fVec::loadu(s);
}
#endif

// part[(h * kVec + p) * kVec ...] = the lanes of q[h] . k[p] for every query head h and the
// m <= kVec positions p of a chunk, whose key rows (float, or bfloat16 widened in registers)
// are read whole and in order, each vector once for up to four heads of its group; lane_sums
// then makes the chunk's scores. The row `ahead` positions on is asked for beside each one
// (pre[p], p < pm). Whole vectors only (D % kVec == 0).
template <int kG, int kD, typename T>
inline void group_parts(const float* q, const T* k, int64_t D, float* part, int64_t p) {
  if constexpr (kD != 0) D = kD;
  // two accumulators per head (even and odd vectors of the head dim): half as long a chain of
  // dependent multiply-adds per position
  fVec acc[kG], acc2[kG];
  for (int g = 0; g < kG; ++g) acc[g] = acc2[g] = fVec(0.f);
  int64_t d = 0;
  for (; d + 2 * kVec <= D; d += 2 * kVec) {
    const fVec kv = load(k + d), kv2 = load(k + d + kVec);
    for (int g = 0; g < kG; ++g) {
      acc[g] = at::vec::fmadd(fVec::loadu(q + g * D + d), kv, acc[g]);
      acc2[g] = at::vec::fmadd(fVec::loadu(q + g * D + d + kVec), kv2, acc2[g]);
    }
  }
  if (d < D) {
    const fVec kv = load(k + d);
    for (int g = 0; g < kG; ++g) acc[g] = at::vec::fmadd(fVec::loadu(q + g * D + d), kv, acc[g]);
  }
  for (int g = 0; g < kG; ++g) (acc[g] + acc2[g]).store(part + (g * kVec + p) * kVec);
}

template <int kD, typename T>
inline void chunk_parts(const float* q, const T* const* rows, int64_t m, int64_t kv_heads,
                        int64_t G, int64_t D, float* part, const T* const* pre, int64_t pm,
                        int64_t row_bytes, int64_t value_offset) {
  for (int64_t p = 0; p < m; ++p) {
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      if (p < pm) prefetch_kv(pre[p] + kh * D, value_offset, row_bytes / kv_heads);
      const T* k = rows[p] + kh * D;
      const float* qh = q + kh * G * D;
      float* ph = part + kh * G * kVec * kVec;
      int64_t g = 0;
      for (; g + 4 <= G; g += 4) group_parts<4, kD>(qh + g * D, k, D, ph + g * kVec * kVec, p);
      switch (G - g) {
        case 3: group_parts<3, kD>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
        case 2: group_parts<2, kD>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
        case 1: group_parts<1, kD>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
        default: break;
      }
    }
  }
}

// acc[g][d, d + kNB * kVec) += sum over p < m of w[g * stride + p] * x[p][d, ...): kG * kNB
// accumulators in registers over the rows, so the multiply-adds of one row do not wait on each
// other (one vector at a time, each accumulator's chain of m dependent adds set the pace).
template <int kG, int kNB, typename T>
inline void rows_axpy(float* acc, const float* w, int64_t stride, const T* const* rows,
                      int64_t m, int64_t off, int64_t D, int64_t d) {
  fVec a[kG][kNB];
  for (int g = 0; g < kG; ++g)
    for (int b = 0; b < kNB; ++b) a[g][b] = fVec::loadu(acc + g * D + d + b * kVec);
  for (int64_t p = 0; p < m; ++p) {
    fVec xv[kNB];
    for (int b = 0; b < kNB; ++b) xv[b] = load(rows[p] + off + d + b * kVec);
    for (int g = 0; g < kG; ++g) {
      const fVec wv(w[g * stride + p]);
      for (int b = 0; b < kNB; ++b) a[g][b] = at::vec::fmadd(wv, xv[b], a[g][b]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int b = 0; b < kNB; ++b) a[g][b].store(acc + g * D + d + b * kVec);
}

// acc[g] += sum over p < m of w[g * stride + p] * x[p] for the G query heads of one kv head and
// the m value rows x[p] = rows[p] + off, kNB vectors of the head dim at a time (at most 8
// accumulators; the chunk's rows stay in L1 between them). The same part of the rows ahead is
// asked for first (pre[p], p < pm; the key pass asked for them too, chunk_parts). Whole vectors
// only.
template <int kG, int kD, typename T>
inline void chunk_axpy_n(float* acc, const float* w, int64_t stride, const T* const* rows,
                         int64_t m, int64_t off, int64_t D, const T* const* pre, int64_t pm) {
  if constexpr (kD != 0) D = kD;
  constexpr int kNB = kG <= 2 ? 4 : 2;
  for (int64_t p = 0; p < pm; ++p) prefetch(pre[p] + off, D * sizeof(T));
  int64_t d = 0;
  for (; d + kNB * kVec <= D; d += kNB * kVec)
    rows_axpy<kG, kNB>(acc, w, stride, rows, m, off, D, d);
  for (; d < D; d += kVec) rows_axpy<kG, 1>(acc, w, stride, rows, m, off, D, d);
}

template <int kD, typename T>
inline void chunk_axpy(float* acc, const float* w, int64_t stride, const T* const* rows,
                       int64_t m, int64_t off, int64_t G, int64_t D, const T* const* pre,
                       int64_t pm) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {  // the rows ahead are asked for once, with the first heads
    chunk_axpy_n<4, kD>(acc + g * D, w + g * stride, stride, rows, m, off, D, pre, pm);
    pm = 0;
  }
  switch (G - g) {
    case 3: chunk_axpy_n<3, kD>(acc + g * D, w + g * stride, stride, rows, m, off, D, pre, pm); break;
    case 2: chunk_axpy_n<2, kD>(acc + g * D, w + g * stride, stride, rows, m, off, D, pre, pm); break;
    case 1: chunk_axpy_n<1, kD>(acc + g * D, w + g * stride, stride, rows, m, off, D, pre, pm); break;
    default: break;
  }
}

inline void scale_row(float* x, float w, int64_t n) {
  const fVec wv(w);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) (fVec::loadu(x + d) * wv).store(x + d);
  for (; d < n; ++d) x[d] *= w;
}

// x[i] = exp(x[i] - m) in place; returns the sum. exp(-inf) = 0 for masked scores.
inline float exp_sum(float* x, float m, int64_t n) {
  const fVec mv(m);
  fVec sv(0.f);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    fVec e = (fVec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    sv = sv + e;
  }
  float s = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sv);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

struct Cache {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  int64_t row_stride;    // elements between consecutive slots (num_kv_heads * head_dim)
  int64_t value_offset;  // elements from a key to its value
};

inline Cache describe(const at::Tensor& kv_cache) {
  return {kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4),
          kv_cache.size(3) * kv_cache.size(4), kv_cache.stride(0)};
}

// Where each part starts: contiguous runs of items of about equal total cost.
std::vector<int64_t> split_by_cost(const std::vector<int64_t>& costs, int64_t parts) {
  int64_t total = 0;
  for (int64_t cost : costs) total += cost;
  std::vector<int64_t> bounds(parts + 1, static_cast<int64_t>(costs.size()));
  bounds[0] = 0;
  int64_t acc = 0, p = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(costs.size()) && p < parts; ++i) {
    acc += costs[i];
    while (p < parts && acc * parts >= total * p) bounds[p++] = i + 1;
  }
  return bounds;
}

// Runs fn(begin, end) over the items, cut into parts of about equal cost: a part a thread
// (OpenMP), or several a thread, claimed one at a time (the kernels' pool, pool.h).
template <typename Fn>
void parallel_by_cost(const std::vector<int64_t>& costs, const Fn& fn) {
  if (costs.empty()) return;
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(pdserve_pool::num_parts(pdserve_pool::num_threads()),
                           static_cast<int64_t>(costs.size())));
  const auto bounds = split_by_cost(costs, parts);
  pdserve_pool::parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) fn(bounds[p], bounds[p + 1]);
  });
}

// The block holding position p, checked against the cache: a bad plan fails, never reads
// outside the cache.
inline int64_t block_at(const int64_t* table, int64_t p, const Cache& c) {
  const int64_t block = table[p / c.block_size];
  PDSERVE_CHECK(block >= 0 && block < c.num_blocks,
                "block id %lld outside the cache of %lld blocks", static_cast<long long>(block),
                static_cast<long long>(c.num_blocks));
  return block;
}

// ---- decode ----

#if PDSERVE_ISA == 2
// Kernels that multiply pairs of bfloat16 into float lanes (vdpbf16ps), for CPUs with
// AVX512-BF16; called only where dp_runs says the CPU has it.
#define PDSERVE_DP __attribute__((target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2")))

// Whether this CPU and head dim take the bfloat16 dot-product kernels (chunk_parts_dp for
// decode, prefill_kernel_dp): rows of whole 32-value vectors.
bool dp_runs(int64_t head_dim) {
  return cpu_has_avx512_bf16() && head_dim % 32 == 0;
}

// chunk_parts for bfloat16 rows and an unscaled bfloat16 query: each 32 values of a key row
// are multiplied as 16 pairs against the query's (exact products, float sums).
template <int kG>
PDSERVE_DP inline void group_parts_dp(const BFloat16* q, const BFloat16* k, int64_t D,
                                      float* part, int64_t p) {
  __m512 acc[kG];
  for (int g = 0; g < kG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + d);
    for (int g = 0; g < kG; ++g)
      acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(q + g * D + d), kv);
  }
  for (int g = 0; g < kG; ++g) _mm512_storeu_ps(part + (g * kVec + p) * kVec, acc[g]);
}

// group_parts_dp over the m positions of a chunk for kB kv heads side by side in the row (from
// `off` on) and kG query heads of each, whose query (kNV vectors of 32 values a head) stays in
// registers: the positions are the inner loop, with no call, switch or reload of the query
// between them, and each position's kB heads are read as one run of its row. The part of the
// row `ahead` positions on that these heads own, keys and values, is asked for beside each one
// (pre[p], p < pm).
template <int kB, int kG, int kNV>
PDSERVE_DP inline void head_parts_dp(const BFloat16* q, const BFloat16* const* rows, int64_t m,
                                     int64_t off, float* part, const BFloat16* const* pre,
                                     int64_t pm, int64_t value_offset) {
  constexpr int64_t kD = 32 * kNV;
  __m512bh qv[kB * kG][kNV];
  for (int h = 0; h < kB * kG; ++h)
    for (int v = 0; v < kNV; ++v)
      qv[h][v] = (__m512bh)_mm512_loadu_si512(q + h * kD + 32 * v);
  for (int64_t p = 0; p < m; ++p) {
    if (p < pm) prefetch_kv(pre[p] + off, value_offset, kB * kD * sizeof(BFloat16));
    const BFloat16* k = rows[p] + off;
    for (int b = 0; b < kB; ++b) {
      __m512bh kv[kNV];
      for (int v = 0; v < kNV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(k + b * kD + 32 * v);
      for (int g = 0; g < kG; ++g) {
        const int h = b * kG + g;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], kv[0]);
        for (int v = 1; v < kNV; ++v) acc = _mm512_dpbf16_ps(acc, qv[h][v], kv[v]);
        _mm512_storeu_ps(part + (h * kVec + p) * kVec, acc);
      }
    }
  }
}

// head_parts_dp over the kv heads of a row, as many at a time as their queries fit in 16
// registers (beside a head's key vectors and an accumulator in AVX-512's 32).
template <int kG, int kNV>
PDSERVE_DP void group_heads_dp(const BFloat16* q, const BFloat16* const* rows, int64_t m,
                               int64_t kv_heads, float* part, const BFloat16* const* pre,
                               int64_t pm, int64_t value_offset) {
  constexpr int64_t kD = 32 * kNV;
  constexpr int kB = std::max(1, std::min(8, 16 / (kG * kNV)));
  int64_t kh = 0;
  for (; kh + kB <= kv_heads; kh += kB)
    head_parts_dp<kB, kG, kNV>(q + kh * kG * kD, rows, m, kh * kD, part + kh * kG * kVec * kVec,
                               pre, pm, value_offset);
  for (; kh < kv_heads; ++kh)
    head_parts_dp<1, kG, kNV>(q + kh * kG * kD, rows, m, kh * kD, part + kh * kG * kVec * kVec,
                              pre, pm, value_offset);
}

// chunk_parts's loop, compiled under the bf16 target itself: a shared template would be built
// without it, and the products could then not be inlined (a call per position and head). kD:
// the head dim when known at compile time: groups of kv heads outer, then the positions, then
// the group's heads, their queries held in registers (group_heads_dp: as many kv heads as fit,
// all of a row's for the 56M Llama, so that each row is read once and in order) where a kv head
// has at most 4 query heads; else one kv head and up to 4 of its query heads at a time; with
// kD = 0, positions outer and every kv head of a row in turn.
template <int kD>
PDSERVE_DP void chunk_parts_dp(const BFloat16* q, const BFloat16* const* rows, int64_t m,
                               int64_t kv_heads, int64_t G, int64_t D, float* part,
                               const BFloat16* const* pre, int64_t pm, int64_t row_bytes,
                               int64_t value_offset) {
  if constexpr (kD != 0) {
    // 256: 16 query vectors, 8 key vectors and an accumulator fit AVX-512's 32 registers
    static_assert(kD % 32 == 0 && kD <= 256, "whole bfloat16 vectors, at most 256 values");
    (void)D;
    (void)row_bytes;
    constexpr int kNV = kD / 32, kMaxG = std::min(4, 16 / kNV);
    if (G <= kMaxG) {
      switch (G) {  // G <= kMaxG: the std::min only keeps unreachable cases compilable
        case 4: group_heads_dp<std::min(4, kMaxG), kNV>(q, rows, m, kv_heads, part, pre, pm,
                                                         value_offset); return;
        case 3: group_heads_dp<std::min(3, kMaxG), kNV>(q, rows, m, kv_heads, part, pre, pm,
                                                         value_offset); return;
        case 2: group_heads_dp<std::min(2, kMaxG), kNV>(q, rows, m, kv_heads, part, pre, pm,
                                                         value_offset); return;
        default: group_heads_dp<1, kNV>(q, rows, m, kv_heads, part, pre, pm, value_offset);
          return;
      }
    }
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      const BFloat16* qh = q + kh * G * kD;
      float* ph = part + kh * G * kVec * kVec;
      for (int64_t g = 0; g < G;) {
        const int64_t n = std::min<int64_t>(kMaxG, G - g);
        const int64_t pn = g == 0 ? pm : 0;  // the rows ahead asked for once per kv head
        const BFloat16* qg = qh + g * kD;
        float* pg = ph + g * kVec * kVec;
        switch (n) {  // n <= kMaxG: the std::min only keeps unreachable cases compilable
          case 4: head_parts_dp<1, std::min(4, kMaxG), kNV>(qg, rows, m, kh * kD, pg, pre, pn,
                                                             value_offset); break;
          case 3: head_parts_dp<1, std::min(3, kMaxG), kNV>(qg, rows, m, kh * kD, pg, pre, pn,
                                                             value_offset); break;
          case 2: head_parts_dp<1, std::min(2, kMaxG), kNV>(qg, rows, m, kh * kD, pg, pre, pn,
                                                             value_offset); break;
          default: head_parts_dp<1, 1, kNV>(qg, rows, m, kh * kD, pg, pre, pn, value_offset);
        }
        g += n;
      }
    }
  } else {
    for (int64_t p = 0; p < m; ++p) {
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        if (p < pm) prefetch_kv(pre[p] + kh * D, value_offset, row_bytes / kv_heads);
        const BFloat16* k = rows[p] + kh * D;
        const BFloat16* qh = q + kh * G * D;
        float* ph = part + kh * G * kVec * kVec;
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) group_parts_dp<4>(qh + g * D, k, D, ph + g * kVec * kVec, p);
        switch (G - g) {
          case 3: group_parts_dp<3>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
          case 2: group_parts_dp<2>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
          case 1: group_parts_dp<1>(qh + g * D, k, D, ph + g * kVec * kVec, p); break;
          default: break;
        }
      }
    }
  }
}

typedef uint32_t u32a __attribute__((may_alias));  // a pair of bfloat16 read as one word

// The value pass for bfloat16 rows where the CPU has AVX512-BF16: acc[g] += w[g][p] v[p] over
// the m positions of a chunk taken two at a time, their rows interleaved into pairs (v[p][d],
// v[p + 1][d]) and multiplied against the pair of weights rounded to bfloat16 (as the prefill
// kernel rounds its probabilities), kNB 32-value blocks of the head dim from d on. Within a
// 128-bit lane the interleave takes 4 values of each half of 8, so the accumulators hold the
// head dim in that order ("paired order": block b's two vectors hold d = 32 b + 8 (i / 4) +
// i % 4 and that + 4, lane i); unpair_acc puts it back. (Interleaving across the whole vector
// instead, as the prefill's interleave_rows does, keeps the head dim's order but its
// permutes ran 0.91-0.99x on a Zen 4.) w: the weights as bfloat16, head g's
// at w + g * ws, an even count with a zero past an odd m; the second row of a last odd pair
// is the first again, under that zero weight.
template <int kG, int kNB>
PDSERVE_DP inline void pairs_axpy_dp(float* acc, const BFloat16* w, int64_t ws,
                                     const BFloat16* const* rows, int64_t m, int64_t off,
                                     int64_t D, int64_t d) {
  __m512 a[kG][2 * kNB];
  for (int g = 0; g < kG; ++g)
    for (int b = 0; b < 2 * kNB; ++b) a[g][b] = _mm512_loadu_ps(acc + g * D + d + 16 * b);
  for (int64_t p = 0; p < m; p += 2) {
    const BFloat16* x = rows[p] + off + d;
    const BFloat16* y = (p + 1 < m ? rows[p + 1] : rows[p]) + off + d;
    __m512i lo[kNB], hi[kNB];
    for (int b = 0; b < kNB; ++b) {
      const __m512i xv = _mm512_loadu_si512(x + 32 * b), yv = _mm512_loadu_si512(y + 32 * b);
      lo[b] = _mm512_unpacklo_epi16(xv, yv);
      hi[b] = _mm512_unpackhi_epi16(xv, yv);
    }
    for (int g = 0; g < kG; ++g) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(*reinterpret_cast<const u32a*>(w + g * ws + p)));
      for (int b = 0; b < kNB; ++b) {
        a[g][2 * b] = _mm512_dpbf16_ps(a[g][2 * b], (__m512bh)lo[b], wv);
        a[g][2 * b + 1] = _mm512_dpbf16_ps(a[g][2 * b + 1], (__m512bh)hi[b], wv);
      }
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int b = 0; b < 2 * kNB; ++b) _mm512_storeu_ps(acc + g * D + d + 16 * b, a[g][b]);
}

// pairs_axpy_dp over the G query heads of one kv head (at most four at a time) and the whole
// head dim (64 values per pass); the same part of the rows ahead is asked for first (pre[p],
// p < pm), as chunk_axpy does.
PDSERVE_DP void chunk_axpy_dp(float* acc, const BFloat16* w, int64_t ws,
                              const BFloat16* const* rows, int64_t m, int64_t off, int64_t G,
                              int64_t D, const BFloat16* const* pre, int64_t pm) {
  for (int64_t p = 0; p < pm; ++p) prefetch(pre[p] + off, D * sizeof(BFloat16));
  for (int64_t g = 0; g < G;) {
    const int64_t n = std::min<int64_t>(4, G - g);
    float* ag = acc + g * D;
    const BFloat16* wg = w + g * ws;
    for (int64_t d = 0; d < D; d += 64) {
      const bool two = d + 64 <= D;
      switch (n * 2 + (two ? 1 : 0)) {
        case 9: pairs_axpy_dp<4, 2>(ag, wg, ws, rows, m, off, D, d); break;
        case 8: pairs_axpy_dp<4, 1>(ag, wg, ws, rows, m, off, D, d); break;
        case 7: pairs_axpy_dp<3, 2>(ag, wg, ws, rows, m, off, D, d); break;
        case 6: pairs_axpy_dp<3, 1>(ag, wg, ws, rows, m, off, D, d); break;
        case 5: pairs_axpy_dp<2, 2>(ag, wg, ws, rows, m, off, D, d); break;
        case 4: pairs_axpy_dp<2, 1>(ag, wg, ws, rows, m, off, D, d); break;
        case 3: pairs_axpy_dp<1, 2>(ag, wg, ws, rows, m, off, D, d); break;
        default: pairs_axpy_dp<1, 1>(ag, wg, ws, rows, m, off, D, d); break;
      }
    }
    g += n;
  }
}

// dst[0, n) = src[0, n) rounded to bfloat16 (nearest even), and dst[n] = 0 where n is odd.
PDSERVE_DP void round_weights(const float* src, int64_t n, BFloat16* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = BFloat16(src[i]);
  if (n % 2) dst[n] = BFloat16(0.f);
}

// A head's accumulators from paired order (pairs_axpy_dp) back to the head dim's.
inline void unpair_acc(const float* paired, int64_t D, float* out) {
  for (int64_t b = 0; b < D; b += 32)
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t d = b + 8 * (i / 4) + i % 4;
      out[d] = paired[b + i];
      out[d + 4] = paired[b + 16 + i];
    }
}
#endif


struct DecodeItem {
  int64_t seq, begin, end;  // positions [begin, end) of one sequence, every kv head
  int64_t partial;          // its index among the partial results, -1 when it is the whole
};

// Items in order of sequence, then partition; first_partial[b]: the index of sequence b's first
// partial result when it has several (the others follow in order).
std::vector<DecodeItem> decode_items(const int64_t* seq_lens, int64_t batch, int64_t max_len,
                                     int64_t partition, std::vector<int64_t>& first_partial) {
  std::vector<DecodeItem> items;
  int64_t partials = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = seq_lens[b];
    PDSERVE_CHECK(len >= 1 && len <= max_len,
                  "sequence %lld has %lld positions; its block table holds %lld",
                  static_cast<long long>(b), static_cast<long long>(len),
                  static_cast<long long>(max_len));
    const int64_t parts = (len + partition - 1) / partition;
    first_partial[b] = partials;
    for (int64_t p = 0; p < parts; ++p)
      items.push_back({b, p * partition, std::min(len, (p + 1) * partition),
                       parts > 1 ? partials++ : -1});
  }
  first_partial[batch] = partials;
  return items;
}

// Rows are read whole (every kv head of a position is one contiguous row of the cache), keys
// first: the scores of the item's positions for every query head, a softmax, then the values.
// kD: the head dim when known at compile time (loops unroll), 0 when it is read at run time.
template <typename T, int kD>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const Cache c = describe(kv_cache);
  const int64_t batch = q.size(0), H = q.size(1), D = kD ? kD : c.head_dim;
  const int64_t G = H / c.num_kv_heads;
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t table_stride = block_tables.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();

  const int64_t P = kPartition;
  const int64_t row_bytes = c.row_stride * sizeof(T);
  const int64_t ahead = std::max<int64_t>(
      1, (std::is_same_v<T, float> ? kAheadBytes : kAheadBytesBf16) / row_bytes);
  std::vector<int64_t> first_partial(batch + 1);
  const auto items = decode_items(lens, batch, block_tables.size(1) * c.block_size, P,
                                  first_partial);
  const int64_t num_partials = first_partial[batch];
  // per partial result: H rows of [max, sum, acc[D]]
  std::vector<float> partials(num_partials * H * (D + 2));
  std::vector<int64_t> costs(items.size());
  for (size_t i = 0; i < items.size(); ++i) costs[i] = items[i].end - items[i].begin + 16;
  const bool whole = D % kVec == 0;
#if PDSERVE_ISA == 2 && !defined(PDSERVE_NO_DECODE_DP)  // (a build for benchmarks/kernel_ab.py)
  // bfloat16 keys multiplied as pairs against the unscaled bfloat16 query (exact products,
  // float sums), the scale applied to the scores
  const bool dp = std::is_same_v<T, BFloat16> && dp_runs(D);
#else
  constexpr bool dp = false;
#endif
#if PDSERVE_ISA == 2 && !defined(PDSERVE_NO_VALUE_DP)
  const bool value_dp = dp;
#else
  constexpr bool value_dp = false;
#endif

  parallel_by_cost(costs, [&](int64_t i_begin, int64_t i_end) {
    std::vector<float> qf(H * D), row(c.row_stride), acc(H * D), scores(H * P), maxes(H), sums(H);
    std::vector<const T*> rows(P);
    std::vector<float> part(H * kVec * kVec);  // lanes past a chunk's last position are not read
    // the value pass on bfloat16 pairs: its weights and its accumulators in paired order
    std::vector<BFloat16> weights(value_dp ? H * (P + 2) : 0);
    std::vector<float> paired(value_dp ? H * D : 0);
    // where the first `count` positions of an item lie: the blocks jump, so rows are
    // prefetched ahead
    auto locate = [&](const DecodeItem& it, int64_t count, const T** dst) {
      const int64_t* table = tables + it.seq * table_stride;
      const int64_t end = it.begin + count;
      for (int64_t p = it.begin; p < end;) {
        const int64_t block = block_at(table, p, c);
        const int64_t slot0 = p % c.block_size;
        const int64_t stop = std::min(end, p - slot0 + c.block_size);
        const T* k = cache + (block * c.block_size + slot0) * c.row_stride;
        for (; p < stop; ++p, k += c.row_stride) dst[p - it.begin] = k;
      }
    };
    // An item's passes ask for rows `ahead` positions on, so nothing asks for its first ones:
    // the next item's first key rows are asked for during this item's value pass, a share at
    // each of its chunks (next_rows), and this item's first value rows beside their key rows.
    std::vector<const T*> next_rows(ahead);
    int64_t next_count = 0;
    auto prefetch_next = [&](int64_t j0, int64_t n) {
      const int64_t share = (next_count * kVec + n - 1) / n;  // rows per chunk of kVec
      const int64_t from = j0 / kVec * share, to = std::min(next_count, from + share);
      for (int64_t r = from; r < to; ++r) prefetch(next_rows[r], row_bytes);
    };
    for (int64_t i = i_begin; i < i_end; ++i) {
      const DecodeItem& it = items[i];
      const int64_t n = it.end - it.begin;
      // load q: every head, scaled, as float
      const T* q_row = q_ptr + it.seq * q_stride;
      if (!dp) {
        const float* qsrc = as_float(q_row, qf.data(), H * D);
        if (qsrc != qf.data()) std::memcpy(qf.data(), qsrc, H * D * 4);
        scale_row(qf.data(), static_cast<float>(scale), H * D);
      }
      locate(it, n, rows.data());
      next_count = i + 1 < i_end ? std::min(ahead, items[i + 1].end - items[i + 1].begin) : 0;
      if (next_count > 0) locate(items[i + 1], next_count, next_rows.data());
      // scores[h, j] for every query head h: key rows once each, read in place kVec at a time
      // where the head dim is whole vectors (bfloat16 pairs multiplied as they lie where the CPU
      // has AVX512-BF16), else through a float copy of the row
      for (int64_t j0 = 0; whole && j0 < n; j0 += kVec) {
        const int64_t m = std::min(kVec, n - j0);
        const int64_t pm = std::clamp<int64_t>(n - j0 - ahead, 0, m);
        const T* const* pre = rows.data() + std::min(n, j0 + ahead);
        for (int64_t p = j0; p < std::min(j0 + m, ahead); ++p)
          prefetch(rows[p] + c.value_offset, row_bytes);
#if PDSERVE_ISA == 2
        if (dp)
          chunk_parts_dp<kD>(reinterpret_cast<const BFloat16*>(q_row),
                         reinterpret_cast<const BFloat16* const*>(rows.data() + j0), m,
                         c.num_kv_heads, G, D, part.data(),
                         reinterpret_cast<const BFloat16* const*>(pre), pm, row_bytes,
                         c.value_offset);
        else
#endif
          chunk_parts<kD>(qf.data(), rows.data() + j0, m, c.num_kv_heads, G, D, part.data(),
                          pre, pm, row_bytes, c.value_offset);
        for (int64_t h = 0; h < H; ++h) {
          fVec sums = lane_sums(part.data() + h * kVec * kVec);
          if (dp) sums = sums * fVec(static_cast<float>(scale));  // the query was not scaled
          sums.store(scores.data() + h * P + j0, m);
        }
      }
      for (int64_t j = 0; !whole && j < n; ++j) {
        if (j + ahead < n) prefetch(rows[j + ahead], row_bytes);
        const float* kf = as_float(rows[j], row.data(), c.row_stride);
        for (int64_t h = 0; h < H; ++h)
          scores[h * P + j] = dot(qf.data() + h * D, kf + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * P;
        maxes[h] = row_max(s, n);
        sums[h] = exp_sum(s, maxes[h], n);
      }
      // acc[h] = sum over p of weight[h, p] * value[p, h / G]: value rows once each
      std::fill(acc.begin(), acc.end(), 0.f);
#if PDSERVE_ISA == 2
      if (value_dp) {  // weights as bfloat16 pairs against the rows' pairs, acc in paired order
        for (int64_t h = 0; h < H; ++h)
          round_weights(scores.data() + h * P, n, weights.data() + h * (P + 2));
        for (int64_t j0 = 0; j0 < n; j0 += kVec) {
          const int64_t m = std::min(kVec, n - j0);
          const int64_t pm = std::clamp<int64_t>(n - j0 - ahead, 0, m);
          const auto* bf_rows = reinterpret_cast<const BFloat16* const*>(rows.data() + j0);
          const auto* bf_pre =
              reinterpret_cast<const BFloat16* const*>(rows.data() + std::min(n, j0 + ahead));
          prefetch_next(j0, n);
          for (int64_t kh = 0; kh < c.num_kv_heads; ++kh)
            chunk_axpy_dp(paired.data() + kh * G * D, weights.data() + kh * G * (P + 2) + j0,
                          P + 2, bf_rows, m, c.value_offset + kh * D, G, D, bf_pre, pm);
        }
        for (int64_t h = 0; h < H; ++h) unpair_acc(paired.data() + h * D, D, acc.data() + h * D);
        std::fill(paired.begin(), paired.end(), 0.f);
      }
#endif
      for (int64_t j0 = 0; whole && !value_dp && j0 < n; j0 += kVec) {
        const int64_t m = std::min(kVec, n - j0);
        const int64_t pm = std::clamp<int64_t>(n - j0 - ahead, 0, m);
        const T* const* pre = rows.data() + std::min(n, j0 + ahead);
        prefetch_next(j0, n);
        for (int64_t kh = 0; kh < c.num_kv_heads; ++kh)
          chunk_axpy<kD>(acc.data() + kh * G * D, scores.data() + kh * G * P + j0, P,
                         rows.data() + j0, m, c.value_offset + kh * D, G, D, pre, pm);
      }
      for (int64_t j = 0; !whole && j < n; ++j) {
        if (j + ahead < n) prefetch(rows[j + ahead] + c.value_offset, row_bytes);
        const float* vf = as_float(rows[j] + c.value_offset, row.data(), c.row_stride);
        for (int64_t h = 0; h < H; ++h)
          axpy(acc.data() + h * D, scores[h * P + j], vf + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h) {
        float* a = acc.data() + h * D;
        if (it.partial < 0) {
          scale_row(a, 1.f / sums[h], D);
          store(out_ptr + it.seq * out_stride + h * D, a, D);
        } else {
          float* dst = partials.data() + (it.partial * H + h) * (D + 2);
          dst[0] = maxes[h];
          dst[1] = sums[h];
          std::memcpy(dst + 2, a, D * 4);
        }
      }
    }
  });
  if (num_partials == 0) return;
  // merge the partitions of long sequences, each rescaled to their common max
  pdserve_pool::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = first_partial[b], parts = first_partial[b + 1] - first;
      if (parts == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        float m = kNegInf, l = 0.f;
        for (int64_t p = 0; p < parts; ++p)
          m = std::max(m, partials[((first + p) * H + h) * (D + 2)]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* part = partials.data() + ((first + p) * H + h) * (D + 2);
          const float w = std::exp(part[0] - m);
          l += w * part[1];
          axpy(acc.data(), w, part + 2, D);
        }
        scale_row(acc.data(), 1.f / l, D);
        store(out_ptr + b * out_stride + h * D, acc.data(), D);
      }
    }
  });
}

// ---- prefill ----

// Column-major BLAS GEMMs, C[m, n] = alpha * op(A) op(B) + beta * C, float accumulators: MKL's
// sgemm_ and gemm_bf16bf16f32_ as libtorch_cpu exports them (ATen's own cpublas::gemm is not
// exported); where they are missing, at::addmm over views for float, and bfloat16 tiles are
// converted to float first.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);
using BgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const BFloat16*, const int*, const BFloat16*, const int*,
                         const float*, float*, const int*);

struct Blas {
  SgemmFn sgemm = nullptr;
  BgemmFn bgemm = nullptr;
};

const Blas& blas() {
  static const Blas found = [] {
    Blas b;
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* scope = torch_cpu ? torch_cpu : RTLD_DEFAULT;
    b.sgemm = reinterpret_cast<SgemmFn>(dlsym(scope, "sgemm_"));
    b.bgemm = reinterpret_cast<BgemmFn>(dlsym(scope, "gemm_bf16bf16f32_"));
    return b;
  }();
  return found;
}

inline void gemm(bool trans_a, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (blas().sgemm) {
    const char ta = trans_a ? 'T' : 'N', tb = 'N';
    const int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
    blas().sgemm(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
  } else {  // row-major views: C^T[n, m] = alpha * B^T[n, k] . op(A)^T[k, m] + beta * C^T
    auto* af = const_cast<float*>(a);
    at::Tensor x = trans_a ? at::from_blob(af, {m, k}, {lda, 1}).t()
                           : at::from_blob(af, {k, m}, {lda, 1});
    at::Tensor bt = at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1});
    at::from_blob(c, {n, m}, {ldc, 1}).addmm_(bt, x, beta, alpha);
  }
}

inline void gemm(bool trans_a, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a,
                 int64_t lda, const BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = 'N';
  const int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
  blas().bgemm(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

// Packs keys (or values) of positions [begin, end) of one kv head into rows of `dst`
// ([end - begin, head_dim], dtype of the GEMM): the tile a GEMM reads stays in cache.
template <typename T, typename G>
void pack_rows(G* dst, const T* base, const int64_t* table, const Cache& c, int64_t head,
               int64_t begin, int64_t end) {
  const int64_t D = c.head_dim;
  for (int64_t p = begin; p < end;) {
    const int64_t block = block_at(table, p, c);
    const int64_t slot0 = p % c.block_size;
    const int64_t stop = std::min(end, p - slot0 + c.block_size);
    const T* src = base + (block * c.block_size + slot0) * c.row_stride + head * D;
    for (; p < stop; ++p, src += c.row_stride, dst += D) {
      if constexpr (std::is_same_v<T, G>) {
        std::memcpy(dst, src, D * sizeof(T));
      } else {
        as_float(src, dst, D);
      }
    }
  }
}

// The online softmax's state of a query tile's rows before its first key tile: maxes and sums
// of `rows` rows, and `values` accumulators (rows x head_dim, or padded rows).
inline void reset_rows(std::vector<float>& maxes, std::vector<float>& sums, std::vector<float>& acc,
                       int64_t rows, int64_t values) {
  std::fill(maxes.begin(), maxes.begin() + rows, kNegInf);
  std::fill(sums.begin(), sums.begin() + rows, 0.f);
  std::fill(acc.begin(), acc.begin() + values, 0.f);
}

// What every prefill kernel reads of its arguments (checked by the op): the cache's shape, the
// group size G, and the pointers and strides of q, the cache, the tables and out.
template <typename T>
struct PrefillArgs {
  PrefillArgs(const at::Tensor& q_, const at::Tensor& kv_cache, const at::Tensor& block_tables,
              const at::Tensor& query_start_loc, const at::Tensor& num_cached, at::Tensor& out_)
      : c(describe(kv_cache)), G(q_.size(1) / c.num_kv_heads), q_stride(q_.stride(0)),
        out_stride(out_.stride(0)), table_stride(block_tables.stride(0)),
        num_seqs(num_cached.size(0)), q(q_.data_ptr<T>()), cache(kv_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int64_t>()), starts(query_start_loc.data_ptr<int64_t>()),
        cached(num_cached.data_ptr<int64_t>()), out(out_.data_ptr<T>()) {}
  Cache c;
  int64_t G, q_stride, out_stride, table_stride, num_seqs;
  int64_t tokens_per_tile = std::max<int64_t>(1, kQueryRows / G);  // kQueryRows rows of G heads
  int64_t key_tile = (kKeyTile + c.block_size - 1) / c.block_size * c.block_size;  // whole blocks
  const T* q;
  const T* cache;
  const int64_t* tables;
  const int64_t* starts;  // query_start_loc
  const int64_t* cached;  // num_cached
  T* out;
  // the first of a sequence's query rows (token `t` of its chunk, head `h`), and its output row
  const T* q_row(int64_t seq, int64_t t, int64_t h) const {
    return q + (starts[seq] + t) * q_stride + h * c.head_dim;
  }
  T* out_row(int64_t seq, int64_t t, int64_t h) const {
    return out + (starts[seq] + t) * out_stride + h * c.head_dim;
  }
};

// A prefill's work items: (sequence, kv head, tile of query tokens); costs[i]: its keys (later
// tiles of a chunk see more of them), for parallel_by_cost.
struct PrefillItem { int64_t seq, head, begin, end; };  // query tokens [begin, end) of the chunk

// `long_tile`: the tokens per tile of a chunk over a prefix of at least kLongPrefix positions
// (arg.tokens_per_tile where a kernel keeps one height);
// `table_blocks`: the block tables' width.
template <typename T>
std::vector<PrefillItem> prefill_items(const PrefillArgs<T>& arg, int64_t table_blocks,
                                       int64_t long_tile, std::vector<int64_t>& costs) {
  const Cache& c = arg.c;
  const int64_t* starts = arg.starts;
  const int64_t* cached = arg.cached;
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s < arg.num_seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    PDSERVE_CHECK(n >= 0 && cached[s] >= 0 && cached[s] + n <= table_blocks * c.block_size,
                  "prefill %lld: %lld cached + %lld new positions do not fit its block table",
                  static_cast<long long>(s), static_cast<long long>(cached[s]),
                  static_cast<long long>(n));
    const int64_t tile = cached[s] >= kLongPrefix ? long_tile : arg.tokens_per_tile;
    for (int64_t h = 0; h < c.num_kv_heads; ++h)
      for (int64_t t = 0; t < n; t += tile) {
        items.push_back({s, h, t, std::min(n, t + tile)});
        costs.push_back((cached[s] + items.back().end) * (items.back().end - t) + 64);
      }
  }
  return items;
}

// T: the cache's dtype; GT: the GEMMs' input dtype (T, or float where the CPU has no fast
// bfloat16 GEMM).
template <typename T, typename GT>
void prefill_kernel(const at::Tensor& q, const at::Tensor& kv_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                    const at::Tensor& num_cached, double scale, at::Tensor& out) {
  const PrefillArgs<T> arg(q, kv_cache, block_tables, query_start_loc, num_cached, out);
  const Cache& c = arg.c;
  const int64_t D = c.head_dim, G = arg.G;

  const int64_t long_tile = std::max<int64_t>(1, kQueryRowsLong / G);
  std::vector<int64_t> costs;
  const std::vector<PrefillItem> items = prefill_items(arg, block_tables.size(1), long_tile, costs);
  int64_t tokens_max = 1;  // the tallest tile of this call: its buffers, no taller
  for (const PrefillItem& it : items) tokens_max = std::max(tokens_max, it.end - it.begin);
  parallel_by_cost(costs, [&](int64_t i_begin, int64_t i_end) {
    const int64_t rows_max = tokens_max * G;
    std::vector<GT> qpack(rows_max * D), kpack(arg.key_tile * D), vpack(arg.key_tile * D),
        ppack(std::is_same_v<GT, float> ? 0 : rows_max * arg.key_tile);
    std::vector<float> scores(rows_max * arg.key_tile), acc(rows_max * D), maxes(rows_max),
        sums(rows_max);
    for (int64_t i = i_begin; i < i_end; ++i) {
      const PrefillItem& it = items[i];
      const int64_t tokens = it.end - it.begin, rows = tokens * G;
      const int64_t offset = arg.cached[it.seq];  // position of the chunk's first query
      const int64_t* table = arg.tables + it.seq * arg.table_stride;
      // load q: row (t, g) of the tile is query token t, head g of the group
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          const T* src = arg.q_row(it.seq, it.begin + t, it.head * G + g);
          GT* dst = qpack.data() + (t * G + g) * D;
          if constexpr (std::is_same_v<T, GT>) std::memcpy(dst, src, D * sizeof(T));
          else as_float(src, dst, D);
        }
      }
      reset_rows(maxes, sums, acc, rows, rows * D);
      const int64_t last_key = offset + it.end;  // keys [0, last_key) are visible to some row
      for (int64_t k0 = 0; k0 < last_key; k0 += arg.key_tile) {
        const int64_t keys = std::min(arg.key_tile, last_key - k0);
        pack_rows(kpack.data(), arg.cache, table, c, it.head, k0, k0 + keys);
        pack_rows(vpack.data(), arg.cache + c.value_offset, table, c, it.head, k0, k0 + keys);
        // scores[rows, keys] = q . k^T (column-major BLAS: scores^T = k . q^T)
        gemm(true, keys, rows, D, static_cast<float>(scale), kpack.data(), D, qpack.data(), D,
             0.f, scores.data(), keys);
        const bool diagonal = k0 + keys > offset + it.begin + 1;
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * keys;
          if (diagonal) {  // keys after the query's own position are not visible
            const int64_t visible = offset + it.begin + r / G + 1 - k0;
            for (int64_t k = std::max<int64_t>(visible, 0); k < keys; ++k) s[k] = kNegInf;
          }
          const float m = std::max(maxes[r], row_max(s, keys));
          if (m == kNegInf) {  // nothing visible yet in this row: it adds nothing
            std::fill(s, s + keys, 0.f);
            continue;
          }
          const float rescale = std::exp(maxes[r] - m);
          sums[r] = sums[r] * rescale + exp_sum(s, m, keys);
          maxes[r] = m;
          scale_row(acc.data() + r * D, rescale, D);
        }
        // acc[rows, D] += p[rows, keys] . v[keys, D]
        if constexpr (std::is_same_v<GT, float>) {
          gemm(false, D, rows, keys, 1.f, vpack.data(), D, scores.data(), keys, 1.f, acc.data(), D);
        } else {
          at::vec::convert(scores.data(), ppack.data(), rows * keys);
          gemm(false, D, rows, keys, 1.f, vpack.data(), D, ppack.data(), keys, 1.f, acc.data(), D);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / G, g = r % G;
        float* a = acc.data() + r * D;
        scale_row(a, 1.f / sums[r], D);
        store(arg.out_row(it.seq, it.begin + t, it.head * G + g), a, D);
      }
    }
  });
}

#if PDSERVE_ISA != 0
// ---- float32 prefill with the query rows in the vector lanes (AVX-512 and AVX2) ----
//
// The float32 counterpart of prefill_kernel_dp: scores are [keys][rows], each key's row
// broadcast against a vector of query rows at a time, so there are no GEMM calls and no
// horizontal reductions (the online softmax is lane-wise). The micro-tiles keep kLanesCols keys
// (or value columns) x kLanesVecs vectors of rows in registers: 8 x 2 of AVX-512's 16 floats
// (32 registers), 4 x 3 of AVX2's 8 (16 registers).
//
// How a tile is walked differs by instruction set (kLanesStrips, kLanesPack):
// - AVX-512 reads keys and values where they lie in the cache and runs each phase (scores,
//   softmax, values) over the whole tile. Against the BLAS kernel on one Zen 4 core: 1.10-1.48x
//   for 16 to 2048 tokens over 0 to 2048 cached; on two, 1.11-1.63x (the GEMM calls scaled
//   1.7-1.9x from one thread to two, this kernel 1.9-2.1x).
// - AVX2 runs all three phases on one strip of rows (one micro-tile high) before the next, so
//   that the strip's scores stay in the first-level cache, in tiles of 144 rows (six 24-row
//   strips); and it packs each key tile's keys and values side by side first (pack_rows): a
//   tile of one head's rows in place spans 128 pages of the cache, twice what the first-level
//   TLB of a Zen 1 maps. Against the BLAS kernel on a Zen 1: 1.11-1.16x for 16 to 2048 tokens
//   over 0 to 2048 cached on one core, 1.08-1.18x on two (the strips alone 1.06-1.14x on one,
//   the packed tiles 1.00-1.06x more).
//
// bfloat16 takes it too where it takes neither AMX's GEMM nor the dot products (an AVX2 CPU; an
// AVX-512 CPU with neither AMX nor AVX512-BF16; without AMX, a head dim that is no multiple of
// 32), its tiles widened to float: 1.09-1.31x the widened tiles' GEMMs on Zen 4 (forced there
// with gemm 0), 1.08-1.22x on Zen 1.

// The lanes kernels' vector operations, over AVX-512's or AVX2's intrinsics (their prefix P).
#define PDSERVE_LANE_OPS(P)                                                               \
  inline lvec lv_load(const float* p) { return P##_loadu_ps(p); }                        \
  inline void lv_store(float* p, lvec x) { P##_storeu_ps(p, x); }                        \
  inline lvec lv_set1(float x) { return P##_set1_ps(x); }                                \
  inline lvec lv_add(lvec a, lvec b) { return P##_add_ps(a, b); }                        \
  inline lvec lv_sub(lvec a, lvec b) { return P##_sub_ps(a, b); }                        \
  inline lvec lv_mul(lvec a, lvec b) { return P##_mul_ps(a, b); }                        \
  inline lvec lv_max(lvec a, lvec b) { return P##_max_ps(a, b); }                        \
  inline lvec lv_fmadd(lvec a, lvec b, lvec c) { return P##_fmadd_ps(a, b, c); }         \
  inline lvec lv_fmsub(lvec a, lvec b, lvec c) { return P##_fmsub_ps(a, b, c); }
#if PDSERVE_ISA == 2
using lvec = __m512;
constexpr int kLanesCols = 8, kLanesVecs = 2;
PDSERVE_LANE_OPS(_mm512)
#else
using lvec = __m256;
constexpr int kLanesCols = 4, kLanesVecs = 3;
PDSERVE_LANE_OPS(_mm256)
#endif
#undef PDSERVE_LANE_OPS
static_assert(sizeof(lvec) == kVec * sizeof(float), "a lanes vector is one at::vec vector");

// x, kept in a register: a micro-tile loads each vector of rows once for all its keys (or
// columns), where the compiler would otherwise fold a load into every multiply-add of it
// (it did so for the bfloat16 kernel's tiles on AVX2: four loads where one is needed).
inline lvec in_register(lvec x) {
  __asm__("" : "+x"(x));
  return x;
}
#if PDSERVE_ISA == 2
constexpr bool kLanesStrips = false, kLanesPack = false;
constexpr int64_t kLanesRows = kQueryRows;  // query rows (tokens x group heads) per tile
#else
constexpr bool kLanesStrips = true, kLanesPack = true;
constexpr int64_t kLanesRows = 144;
#endif

// Scores s[key][row] (rp rows, keys k0 + 0 .. padded) set to -inf where a row may not see the
// key: padding keys (from `keys` on), and keys past the row's own position pos[row] (a tile on
// the diagonal; the tile's first query is at `first`). For prefill_kernel_lanes and _dp.
inline void hide_keys(float* s, int64_t rp, const int32_t* pos, int64_t first, int64_t k0,
                      int64_t keys, int64_t padded) {
  for (int64_t kk = std::clamp<int64_t>(first - k0 + 1, 0, keys); kk < padded; ++kk) {
    const int32_t kpos = static_cast<int32_t>(k0 + kk);
    for (int64_t r = 0; r < rp; r += kVec) {
      float* sv = s + kk * rp + r;
#if PDSERVE_ISA == 2
      const __mmask16 hide = kk >= keys ? __mmask16(0xffff)
                                        : _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(kpos),
                                                                  _mm512_loadu_si512(pos + r));
      _mm512_storeu_ps(sv, _mm512_mask_mov_ps(_mm512_loadu_ps(sv), hide,
                                              _mm512_set1_ps(kNegInf)));
#else
      const __m256i later = _mm256_cmpgt_epi32(
          _mm256_set1_epi32(kpos), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + r)));
      const __m256 hide = kk >= keys ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                                     : _mm256_castsi256_ps(later);
      _mm256_storeu_ps(sv, _mm256_blendv_ps(_mm256_loadu_ps(sv), _mm256_set1_ps(kNegInf), hide));
#endif
    }
  }
}

// 2^t in each lane for the online softmax's exponents t (scores times scale * log2(e) less
// their running max likewise: at most a rounding error above 0; a hidden key's -inf gives 0):
// t = n + f with n the nearest integer and |f| <= 1/2, 2^f by a degree-5 polynomial (within
// 2e-7 of it), times 2^n (vscalefps; on AVX2 a multiply by 2^n built in the exponent bits).
// Lanes under 2^-126, the smallest normal float, are 0 (at::vec's exp_u20 gives 0 there too).
// Ten operations a vector where exp_u20 takes about twenty (its range checks and integer
// exponent): prefill_kernel_dp's softmax, its max pass included, was ~20% of its time on a Zen
// 4 with exp_u20, ~16% of the shorter time with this (before the max came from the score
// micro-tiles, update_tile_max).
inline lvec exp2_lanes(lvec t) {
#if PDSERVE_ISA == 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  const lvec f = lv_sub(t, n);
  lvec p = lv_fmadd(lv_set1(1.3264654e-3f), f, lv_set1(9.6715139e-3f));
  p = lv_fmadd(p, f, lv_set1(5.5507340e-2f));
  p = lv_fmadd(p, f, lv_set1(2.4022242e-1f));
  p = lv_fmadd(p, f, lv_set1(6.9314700e-1f));
  p = lv_fmadd(p, f, lv_set1(1.f));
#if PDSERVE_ISA == 2
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  const __m256 normal = _mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), normal);
#endif
}

// The online softmax of a query tile whose rows sit in the vector lanes (prefill_kernel_lanes
// and _dp): per row r of rp (whole vectors), its position, running max and sum, and its
// accumulators o[d][r]. Scores are q . k unscaled: the softmax's exponents take the scale
// (`c` = scale * log2(e), exp2_lanes; a positive scale, checked by the op), and the running
// maxima are kept times c. tmax: the rows' max over the current key tile, gathered by the
// score micro-tiles (update_tile_max).
struct LaneRows {
  std::vector<float> maxes, sums, o, tmax;
  std::vector<int32_t> pos;
  lvec c;
  LaneRows(int64_t rp_max, int64_t D, double scale)
      : maxes(rp_max), sums(rp_max), o(D * rp_max), tmax(rp_max), pos(rp_max),
        c(lv_set1(static_cast<float>(scale * M_LOG2E))) {}

  // A tile of `rows` rows (G heads per token, padded to rp) whose first token is at `first`:
  // padding rows take the last row's position, so they see what it sees.
  void start(int64_t rp, int64_t rows, int64_t G, int64_t first, int64_t D) {
    for (int64_t r = 0; r < rp; ++r)
      pos[r] = static_cast<int32_t>(first + std::min(r, rows - 1) / G);
    reset_rows(maxes, sums, o, rp, D * rp);
  }

  // The key tile [k0, k0 + keys) begins (padded to `padded` keys with padding the rows
  // hide): tmax reset for its score micro-tiles. Returns whether tmax will be the rows' max
  // over the tile's scores as the softmax sees them: every row sees every key and none is
  // padding, so hide_keys, which runs after the micro-tiles, hides nothing.
  bool begin_tile(int64_t rp, int64_t first, int64_t k0, int64_t keys, int64_t padded) {
    std::fill(tmax.begin(), tmax.begin() + rp, kNegInf);
    return keys == padded && k0 + keys - 1 <= first;
  }

  // Lanes [r, r + kVec) of a tile of rp rows meet their scores over a key tile, s[key * lds]
  // (`padded` keys): their running max times c becomes mc (stored), their accumulators are
  // scaled by 2^(old mc - mc); returns their sum scaled likewise, to which the caller adds the
  // tile's probabilities 2^(s c - mc) (`probs`). Every exponent subtracts the same stored mc,
  // so its rounding cancels between key tiles. The tile's max: tmax where begin_tile said so
  // (`all_seen`), else a pass over the scores after hide_keys.
  lvec rescale(const float* s, int64_t lds, int64_t padded, int64_t r, int64_t rp, int64_t D,
               bool all_seen, lvec& mc) {
    lvec m = lv_set1(kNegInf);
    if (all_seen)
      m = lv_load(tmax.data() + r);
    else
      for (int64_t kk = 0; kk < padded; ++kk)
        m = lv_max(m, lv_load(s + kk * lds));
    const lvec mc_old = lv_load(maxes.data() + r);
    // key 0 is visible to every row, so from the first tile on every lane's max is finite (a
    // later tile may hide all its keys from a row: m -inf there, mc stays)
    mc = lv_max(mc_old, lv_mul(m, c));
    const lvec factor = exp2_lanes(lv_sub(mc_old, mc));
    lv_store(maxes.data() + r, mc);
    for (int64_t d = 0; d < D; ++d) {
      float* od = o.data() + d * rp + r;
      lv_store(od, lv_mul(lv_load(od), factor));
    }
    return lv_mul(lv_load(sums.data() + r), factor);
  }

  // The probabilities of scores s against their lanes' running max times c, mc.
  lvec probs(lvec s, lvec mc) const { return exp2_lanes(lv_fmsub(s, c, mc)); }
};

// tile_max[kVec v + lane] = the max of itself and a score micro-tile's kCols keys, for its NV
// vectors of rows: the rows' max over a key tile gathered while its scores are in registers
// (LaneRows::tmax).
template <int kCols, int NV>
inline void update_tile_max(const lvec (&acc)[kCols][NV], float* tile_max) {
  for (int v = 0; v < NV; ++v) {
    lvec m = lv_load(tile_max + kVec * v);
    for (int i = 0; i < kCols; ++i) m = lv_max(m, acc[i][v]);
    lv_store(tile_max + kVec * v, m);
  }
}

// s[c][r] = q_r . k_c for kLanesCols keys c (rows k[c] of D values) and kVec NV query rows r
// of the packed queries at qp (qp[d * ldq + r]), stored at s[c * lds + r]; their max per row
// into tile_max[r].
template <int NV>
inline void lanes_scores(const float* const* k, const float* qp, int64_t ldq, int64_t D,
                         float* s, int64_t lds, float* tile_max) {
  lvec acc[kLanesCols][NV];
  for (auto& row : acc)
    for (auto& x : row) x = lv_set1(0.f);
  const float* kr[kLanesCols];
  for (int i = 0; i < kLanesCols; ++i) kr[i] = k[i];
  for (int64_t d = 0; d < D; ++d) {
    lvec qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = in_register(lv_load(qp + d * ldq + kVec * v));
#pragma GCC unroll 8
    for (int i = 0; i < kLanesCols; ++i) {
      const lvec kv = lv_set1(kr[i][d]);
      for (int v = 0; v < NV; ++v) acc[i][v] = lv_fmadd(kv, qv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kLanesCols; ++i)
    for (int v = 0; v < NV; ++v) lv_store(s + i * lds + kVec * v, acc[i][v]);
  update_tile_max<kLanesCols, NV>(acc, tile_max);
}

// o[d * ldo + r] += sum over `keys` keys of p[key * ldp + r] v[key][d] for the kLanesCols
// columns d0.. of the value rows v[key] and kVec NV rows r.
template <int NV>
inline void lanes_values(const float* const* v_rows, int64_t keys, int64_t d0, const float* p,
                         int64_t ldp, float* o, int64_t ldo) {
  lvec acc[kLanesCols][NV];
  for (int i = 0; i < kLanesCols; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = lv_load(o + (d0 + i) * ldo + kVec * v);
  for (int64_t kk = 0; kk < keys; ++kk) {
    lvec pv[NV];
    for (int v = 0; v < NV; ++v) pv[v] = in_register(lv_load(p + kk * ldp + kVec * v));
    const float* vr = v_rows[kk] + d0;
#pragma GCC unroll 8
    for (int i = 0; i < kLanesCols; ++i) {
      const lvec x = lv_set1(vr[i]);
      for (int v = 0; v < NV; ++v) acc[i][v] = lv_fmadd(x, pv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kLanesCols; ++i)
    for (int v = 0; v < NV; ++v) lv_store(o + (d0 + i) * ldo + kVec * v, acc[i][v]);
}

// fn(nv, r0) for the rows [begin, end) (whole vectors) in micro-tiles of kLanesVecs vectors
// from r0, the last one shorter: nv is std::integral_constant<int, vectors>.
template <typename Fn>
inline void row_tiles(int64_t begin, int64_t end, const Fn& fn) {
  int64_t r0 = begin;
  for (; r0 + kLanesVecs * kVec <= end; r0 += kLanesVecs * kVec)
    fn(std::integral_constant<int, kLanesVecs>{}, r0);
  const int64_t left = (end - r0) / kVec;  // fewer than kLanesVecs
  if (left == 2) fn(std::integral_constant<int, 2>{}, r0);
  if (left == 1) fn(std::integral_constant<int, 1>{}, r0);
}

// T: the cache's dtype. A bfloat16 tile's keys and values are widened to float first, once per
// tile (pack_rows), and products run as float32's.
template <typename T>
void prefill_kernel_lanes(const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& num_cached, double scale, at::Tensor& out) {
  PrefillArgs<T> arg(q, kv_cache, block_tables, query_start_loc, num_cached, out);
  const Cache& c = arg.c;
  const int64_t D = c.head_dim, G = arg.G;
  arg.tokens_per_tile = std::max<int64_t>(1, kLanesRows / G);

  const int64_t keys_max = (arg.key_tile + kLanesCols - 1) / kLanesCols * kLanesCols;
  const int64_t cols = D / kLanesCols * kLanesCols;  // value columns in whole micro-tiles
  std::vector<int64_t> costs;
  const std::vector<PrefillItem> items = prefill_items(arg, block_tables.size(1),
                                                       arg.tokens_per_tile, costs);
  parallel_by_cost(costs, [&](int64_t i_begin, int64_t i_end) {
    const int64_t rp_max = (arg.tokens_per_tile * G + kVec - 1) / kVec * kVec;
    // scores s[key][row] of a strip's rows, or of the whole tile's
    const int64_t s_width = kLanesStrips ? kLanesVecs * kVec : rp_max;
    std::vector<float> qp(D * rp_max), s(keys_max * s_width), zero(D, 0.f), row(D);
    LaneRows lr(rp_max, D, scale);
    std::vector<float>& o = lr.o;
    constexpr bool kPack = kLanesPack || !std::is_same_v<T, float>;
    std::vector<float> kpack(kPack ? keys_max * D : 0), vpack(kPack ? keys_max * D : 0);
    std::vector<const float*> krows(keys_max), vrows(keys_max);
    for (int64_t i = i_begin; i < i_end; ++i) {
      const PrefillItem& it = items[i];
      const int64_t tokens = it.end - it.begin, rows = tokens * G;
      const int64_t rp = (rows + kVec - 1) / kVec * kVec;
      const int64_t first = arg.cached[it.seq] + it.begin;  // the tile's first query position
      const int64_t* table = arg.tables + it.seq * arg.table_stride;
      // qp[d][r]: query row r = (token r / G, head r % G of the group); padding rows 0 (they
      // are not written out)
      for (int64_t r = 0; r < rp; ++r) {
        const int64_t rr = std::min(r, rows - 1);
        const T* src = arg.q_row(it.seq, it.begin + rr / G, it.head * G + rr % G);
        for (int64_t d = 0; d < D; ++d)
          qp[d * rp + r] = r < rows ? static_cast<float>(src[d]) : 0.f;
      }
      lr.start(rp, rows, G, first, D);
      const int64_t last_key = first + tokens;  // keys [0, last_key) are visible to some row
      for (int64_t k0 = 0; k0 < last_key; k0 += arg.key_tile) {
        const int64_t keys = std::min(arg.key_tile, last_key - k0);
        const int64_t padded = (keys + kLanesCols - 1) / kLanesCols * kLanesCols;
        const bool all_seen = lr.begin_tile(rp, first, k0, keys, padded);
        if constexpr (kPack) {
          pack_rows(kpack.data(), arg.cache, table, c, it.head, k0, k0 + keys);
          pack_rows(vpack.data(), arg.cache + c.value_offset, table, c, it.head, k0, k0 + keys);
          for (int64_t p = 0; p < keys; ++p) {
            krows[p] = kpack.data() + p * D;
            vrows[p] = vpack.data() + p * D;
          }
        } else {
          for (int64_t p = k0; p < k0 + keys; ++p) {
            const int64_t slot = block_at(table, p, c) * c.block_size + p % c.block_size;
            krows[p - k0] = arg.cache + slot * c.row_stride + it.head * D;
            vrows[p - k0] = krows[p - k0] + c.value_offset;
          }
        }
        for (int64_t p = keys; p < padded; ++p) krows[p] = vrows[p] = zero.data();
        // The phases over the rows [r_begin, r_end) of the tile, whose scores sit at sb (row
        // r_begin's first, lds floats from one key's scores to the next's).
        auto scores = [&](int64_t r_begin, int64_t r_end, float* sb, int64_t lds) {
          for (int64_t kc = 0; kc < padded; kc += kLanesCols)
            row_tiles(r_begin, r_end, [&](auto nv, int64_t r0) {
              lanes_scores<decltype(nv)::value>(krows.data() + kc, qp.data() + r0, rp, D,
                                                sb + kc * lds + r0 - r_begin, lds,
                                                lr.tmax.data() + r0);
            });
          hide_keys(sb, lds, lr.pos.data() + r_begin, first, k0, keys, padded);
        };
        // sb's scores become the probabilities, lane by lane
        auto softmax = [&](int64_t r_begin, int64_t r_end, float* sb, int64_t lds) {
          for (int64_t r = r_begin; r < r_end; r += kVec) {
            float* sv = sb + r - r_begin;
            lvec mc;
            lvec sum = lr.rescale(sv, lds, padded, r, rp, D, all_seen, mc);
            for (int64_t kk = 0; kk < padded; ++kk) {
              const lvec p = lr.probs(lv_load(sv + kk * lds), mc);
              lv_store(sv + kk * lds, p);
              sum = lv_add(sum, p);
            }
            lv_store(lr.sums.data() + r, sum);
          }
        };
        // o[d][row] += p . v
        auto values = [&](int64_t r_begin, int64_t r_end, const float* sb, int64_t lds) {
          for (int64_t d0 = 0; d0 < cols; d0 += kLanesCols)
            row_tiles(r_begin, r_end, [&](auto nv, int64_t r0) {
              lanes_values<decltype(nv)::value>(vrows.data(), padded, d0, sb + r0 - r_begin,
                                                lds, o.data() + r0, rp);
            });
          for (int64_t d = cols; d < D; ++d)  // a head dim that is no multiple of kLanesCols
            for (int64_t kk = 0; kk < keys; ++kk)
              for (int64_t r = r_begin; r < r_end; r += kVec) {
                float* od = o.data() + d * rp + r;
                lv_store(od, lv_fmadd(lv_set1(vrows[kk][d]), lv_load(sb + kk * lds + r - r_begin),
                                      lv_load(od)));
              }
        };
        if constexpr (kLanesStrips) {
          row_tiles(0, rp, [&](auto nv, int64_t r0) {
            const int64_t w = decltype(nv)::value * kVec;
            scores(r0, r0 + w, s.data(), w);
            softmax(r0, r0 + w, s.data(), w);
            values(r0, r0 + w, s.data(), w);
          });
        } else {
          scores(0, rp, s.data(), rp);
          softmax(0, rp, s.data(), rp);
          values(0, rp, s.data(), rp);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / lr.sums[r];
        for (int64_t d = 0; d < D; ++d) row[d] = o[d * rp + r] * inv;
        store(arg.out_row(it.seq, it.begin + r / G, it.head * G + r % G), row.data(), D);
      }
    }
  });
}

#endif

#if PDSERVE_ISA == 2
// ---- prefill on bfloat16 dot products (AVX512-BF16 without AMX) ----
//
// Where MKL's bfloat16 GEMM is slow (it is on AMD's AVX512-BF16 CPUs) and converting the tiles
// to float halves the multiply rate, this variant multiplies pairs of bfloat16 into float lanes
// (vdpbf16ps) with the tile's *query rows in the lanes*: scores are [keys][rows], so each key's
// row is read where it lies in the cache, two values at a time broadcast against 16 query rows,
// and the online softmax is lane-wise (no horizontal reductions). The probabilities are rounded
// to bfloat16 for the value product, as the AMX path rounds them; sums and accumulators stay
// float. Head dims that are multiples of 32 (the values are interleaved in pairs 32 at a time).

constexpr int64_t kDpCols = 8;                       // broadcast words per micro-tile

// acc[i][v] += sum over j < n of pair a[i][j * a_step] . pairs b[j * b_step + 16 v, + 16)
template <int NV>
PDSERVE_DP inline void dp_tile(const u32a* const* a, int64_t a_step, const u32a* b,
                               int64_t b_step, int64_t n, __m512 (&acc)[kDpCols][NV]) {
  for (int64_t j = 0; j < n; ++j) {
    __m512bh bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      bv[v] = (__m512bh)_mm512_loadu_si512(b + j * b_step + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < kDpCols; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i][j * a_step]));
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
}

// s[c][r] = q_r . k_c for kDpCols keys c (rows k[c] of head_dim values, as pairs) and the rows
// [r0, r0 + 16 NV) of the packed queries qp[pair][rows]; their max per row into tile_max[r0...].
template <int NV>
PDSERVE_DP inline void dp_scores(const u32a* const* k, const u32a* qp, int64_t rp, int64_t pairs,
                                 int64_t r0, float* s, float* tile_max) {
  __m512 acc[kDpCols][NV];
  for (auto& row : acc)
    for (auto& x : row) x = _mm512_setzero_ps();
  dp_tile<NV>(k, 1, qp + r0, rp, pairs, acc);
  for (int i = 0; i < kDpCols; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + i * rp + r0 + 16 * v, acc[i][v]);
  update_tile_max<kDpCols, NV>(acc, tile_max + r0);
}

// o[d][r] += sum over keys of p[key][r] v[key][d] for kDpCols columns d0.. of the packed values
// vp[key pair][D] and the rows [r0, r0 + 16 NV) of the packed probabilities pp[key pair][rows].
template <int NV>
PDSERVE_DP inline void dp_values(const u32a* vp, int64_t D, int64_t d0, const u32a* pp,
                                 int64_t rp, int64_t key_pairs, int64_t r0, float* o) {
  const u32a* cols[kDpCols];
  for (int i = 0; i < kDpCols; ++i) cols[i] = vp + d0 + i;
  __m512 acc[kDpCols][NV];
  for (int i = 0; i < kDpCols; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_loadu_ps(o + (d0 + i) * rp + r0 + 16 * v);
  dp_tile<NV>(cols, D, pp + r0, rp, key_pairs, acc);
  for (int i = 0; i < kDpCols; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + (d0 + i) * rp + r0 + 16 * v, acc[i][v]);
}

// dst[d] = (a[d], b[d]) for d < D: two value rows interleaved into pairs, 32 values at a time.
PDSERVE_DP inline void interleave_rows(const BFloat16* a, const BFloat16* b, int64_t D,
                                       u32a* dst) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6,
                                              38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44,
                                              13, 45, 14, 46, 15, 47};
  const __m512i ilo = _mm512_load_si512(lo);
  const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
    _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, ilo, y));
    _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, ihi, y));
  }
}

// 16 words (p0[r], p1[r]) from two float vectors, each rounded to bfloat16 (nearest even).
PDSERVE_DP inline __m512i pair_probs(__m512 p0, __m512 p1) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                                 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                                 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 low half, p1 high half
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

PDSERVE_DP void prefill_kernel_dp(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc,
                                  const at::Tensor& num_cached, double scale, at::Tensor& out) {
  const PrefillArgs<BFloat16> arg(q, kv_cache, block_tables, query_start_loc, num_cached, out);
  const Cache& c = arg.c;
  const int64_t D = c.head_dim, pairs = D / 2, G = arg.G;

  const int64_t keys_max = (arg.key_tile + kDpCols - 1) / kDpCols * kDpCols;
  std::vector<int64_t> costs;
  const std::vector<PrefillItem> items = prefill_items(arg, block_tables.size(1),
                                                       arg.tokens_per_tile, costs);
  parallel_by_cost(costs, [&](int64_t i_begin, int64_t i_end) {
    const int64_t rp_max = (arg.tokens_per_tile * G + 15) / 16 * 16;
    std::vector<uint32_t> qp(pairs * rp_max), pp(keys_max / 2 * rp_max), vp(keys_max / 2 * D),
        zero(pairs, 0);
    std::vector<float> s(keys_max * rp_max);
    LaneRows lr(rp_max, D, scale);
    std::vector<float>& o = lr.o;
    std::vector<const u32a*> krows(keys_max);
    std::vector<const BFloat16*> vrows(keys_max);
    const auto* zero_row = reinterpret_cast<const u32a*>(zero.data());
    for (int64_t i = i_begin; i < i_end; ++i) {
      const PrefillItem& it = items[i];
      const int64_t tokens = it.end - it.begin, rows = tokens * G, rp = (rows + 15) / 16 * 16;
      const int64_t first = arg.cached[it.seq] + it.begin;  // the tile's first query position
      const int64_t* table = arg.tables + it.seq * arg.table_stride;
      // qp[j][r]: pair j of query row r = (token r / G, head r % G of the group); padding 0
      for (int64_t r = 0; r < rp; ++r) {
        const int64_t rr = std::min(r, rows - 1);
        const auto* src = reinterpret_cast<const u32a*>(
            arg.q_row(it.seq, it.begin + rr / G, it.head * G + rr % G));
        for (int64_t j = 0; j < pairs; ++j) qp[j * rp + r] = r < rows ? src[j] : 0u;
      }
      lr.start(rp, rows, G, first, D);
      const int64_t last_key = first + tokens;  // keys [0, last_key) are visible to some row
      for (int64_t k0 = 0; k0 < last_key; k0 += arg.key_tile) {
        const int64_t keys = std::min(arg.key_tile, last_key - k0);
        const int64_t padded = (keys + kDpCols - 1) / kDpCols * kDpCols;
        const bool all_seen = lr.begin_tile(rp, first, k0, keys, padded);
        for (int64_t p = k0; p < k0 + keys; ++p) {
          const int64_t row = block_at(table, p, c) * c.block_size + p % c.block_size;
          const BFloat16* kr = arg.cache + row * c.row_stride + it.head * D;
          krows[p - k0] = reinterpret_cast<const u32a*>(kr);
          vrows[p - k0] = kr + c.value_offset;
        }
        for (int64_t p = keys; p < padded; ++p) {
          krows[p] = zero_row;
          vrows[p] = reinterpret_cast<const BFloat16*>(zero.data());
        }
        // scores s[key][row]
        for (int64_t kc = 0; kc < padded; kc += kDpCols) {
          int64_t r0 = 0;
          for (; r0 + 32 <= rp; r0 += 32)
            dp_scores<2>(krows.data() + kc, qp.data(), rp, pairs, r0, s.data() + kc * rp,
                         lr.tmax.data());
          if (r0 < rp)
            dp_scores<1>(krows.data() + kc, qp.data(), rp, pairs, r0, s.data() + kc * rp,
                         lr.tmax.data());
        }
        hide_keys(s.data(), rp, lr.pos.data(), first, k0, keys, padded);
        // online softmax per lane; probabilities to bfloat16 pairs pp[key pair][row]
        for (int64_t v = 0; v < rp / 16; ++v) {
          const float* sv = s.data() + v * 16;
          __m512 mc;
          __m512 sum = lr.rescale(sv, rp, padded, v * 16, rp, D, all_seen, mc);
          for (int64_t kk = 0; kk < padded; kk += 2) {
            const __m512 p0 = lr.probs(_mm512_loadu_ps(sv + kk * rp), mc);
            const __m512 p1 = lr.probs(_mm512_loadu_ps(sv + (kk + 1) * rp), mc);
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(pp.data() + kk / 2 * rp + v * 16, pair_probs(p0, p1));
          }
          _mm512_storeu_ps(lr.sums.data() + v * 16, sum);
        }
        // values as pairs of keys, then o[d][row] += p . v
        for (int64_t kk = 0; kk < padded; kk += 2)
          interleave_rows(vrows[kk], vrows[kk + 1], D,
                          reinterpret_cast<u32a*>(vp.data()) + kk / 2 * D);
        for (int64_t d0 = 0; d0 < D; d0 += kDpCols) {
          int64_t r0 = 0;
          for (; r0 + 32 <= rp; r0 += 32)
            dp_values<2>(reinterpret_cast<const u32a*>(vp.data()), D, d0,
                         reinterpret_cast<const u32a*>(pp.data()), rp, padded / 2, r0, o.data());
          if (r0 < rp)
            dp_values<1>(reinterpret_cast<const u32a*>(vp.data()), D, d0,
                         reinterpret_cast<const u32a*>(pp.data()), rp, padded / 2, r0, o.data());
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / lr.sums[r];
        BFloat16* dst = arg.out_row(it.seq, it.begin + r / G, it.head * G + r % G);
        for (int64_t d = 0; d < D; ++d) dst[d] = BFloat16(o[d * rp + r] * inv);
      }
    }
  });
}

#endif

// AMX's tile intrinsics need GCC 11 or clang 12; an older compiler builds the rest without them
#if PDSERVE_ISA == 2 && ((defined(__clang__) && __clang_major__ >= 12) || \
                         (!defined(__clang__) && __GNUC__ >= 11))
#define PDSERVE_AMX_BUILD 1
#else
#define PDSERVE_AMX_BUILD 0
#endif
#if PDSERVE_AMX_BUILD
// ---- bfloat16 prefill on AMX tiles ----
//
// prefill_kernel's walk (query tiles of G heads' rows, the prefix in key tiles, the online
// softmax in float between) with both products on the CPU's tile unit (tdpbf16ps: a 16 x 16
// float tile += 16 x 32 bfloat16 rows . 32 x 16 bfloat16 pairs) instead of MKL's bfloat16
// GEMMs, which ran head_dim-64 tiles at about 120 GFLOP/s a thread on a 2-core Xeon with AMX.
// Each key tile is laid out as the tile unit reads it: keys transposed into dword pairs of the
// head dim (Kt: 16 keys a tile, 32 head-dim values down), values interleaved by pairs of keys
// (Vt: 32 keys a tile, 16 head-dim values across). Eight tiles of 16 rows x 64 bytes, one
// configuration for every product: 0-3 four float results at a time (a product's latency is
// several times its issue interval, so one result tile's chain would leave the unit idle), 4
// the rows they share (queries, or probabilities), 6 and 7 in turn the keys or values.
#define PDSERVE_AMX __attribute__((target(                                              \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c,bmi,bmi2")))

// Whether this CPU has AMX's bfloat16 tiles and Linux lets this process use them (it hands out
// the tiles' state only on request, arch_prctl ARCH_REQ_XCOMP_PERM; once per process).
bool amx_runs(int64_t head_dim) {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok && head_dim % 64 == 0;  // the products go four 16-value tiles at a time
}

constexpr int64_t kTileRows = 16, kTileBytes = 64;

struct alignas(64) TileConfig {  // palette 1: tiles 0-7, each 16 rows of 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {kTileBytes, kTileBytes, kTileBytes, kTileBytes,
                        kTileBytes, kTileBytes, kTileBytes, kTileBytes};
  uint8_t rows[16] = {kTileRows, kTileRows, kTileRows, kTileRows,
                      kTileRows, kTileRows, kTileRows, kTileRows};
};

// Static: built on the stack in a small function, GCC 12.2 stored only the first 32 of the 64
// bytes that ldtilecfg reads, and the widths and rows it left as garbage faulted.
const TileConfig kTileConfig;

// keys [0, n) of `src` ([n][D] bfloat16, n a multiple of 16) as Kt: for each 16 keys j and 32
// head-dim values b, a tile whose row r holds the pair (2r, 2r + 1) of b's values of the 16
// keys, at dst + (j * D / 32 + b) * 512.
PDSERVE_AMX void pack_keys_amx(const BFloat16* src, int64_t n, int64_t D, BFloat16* dst) {
  const int64_t words = D / 2;  // a key row as pairs
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(words)));
  const auto* s = reinterpret_cast<const int32_t*>(src);
  for (int64_t j = 0; j < n / 16; ++j)
    for (int64_t b = 0; b < D / 32; ++b) {
      BFloat16* tile = dst + (j * (D / 32) + b) * 512;
      for (int64_t r = 0; r < 16; ++r)
        _mm512_storeu_si512(tile + 32 * r,
                            _mm512_i32gather_epi32(idx, s + j * 16 * words + 16 * b + r, 4));
    }
}

// values [0, n) of `src` ([n][D] bfloat16, n a multiple of 32) as Vt: for each 32 keys j and 16
// head-dim values b, a tile whose row r holds (v[2r][d], v[2r + 1][d]) for b's 16 values d, at
// dst + (j * D / 16 + b) * 512.
PDSERVE_AMX void pack_values_amx(const BFloat16* src, int64_t n, int64_t D, BFloat16* dst) {
  for (int64_t j = 0; j < n / 32; ++j)
    for (int64_t b = 0; b < D / 16; ++b) {
      BFloat16* tile = dst + (j * (D / 16) + b) * 512;
      for (int64_t r = 0; r < 16; ++r) {
        const BFloat16* x = src + (32 * j + 2 * r) * D + 16 * b;
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + D)));
        _mm512_storeu_si512(tile + 32 * r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
}

// One thread's items of prefill_kernel_amx: the tile configuration is the thread's own.
struct AmxPrefill {
  const PrefillArgs<BFloat16>& arg;
  const std::vector<PrefillItem>& items;
  int64_t key_width, rows_cap;  // a key tile's width (whole groups of 64), the tallest tile
  float c;  // scale * log2(e): the exponents' base-2 factor
};

PDSERVE_AMX void prefill_items_amx(const AmxPrefill& w, int64_t i_begin, int64_t i_end) {
  const PrefillArgs<BFloat16>& arg = w.arg;
  const Cache& c = arg.c;
  const int64_t D = c.head_dim, G = arg.G, KP = w.key_width;
  _tile_loadconfig(&kTileConfig);
  std::vector<BFloat16> qpack(w.rows_cap * D), kpack(KP * D), vpack(KP * D), kt(KP * D),
      vt(KP * D), ppack(w.rows_cap * KP);
  std::vector<float> scores(w.rows_cap * KP), acc(w.rows_cap * D), maxes(w.rows_cap),
      sums(w.rows_cap);
  for (int64_t i = i_begin; i < i_end; ++i) {
    const PrefillItem& it = w.items[i];
    const int64_t tokens = it.end - it.begin, rows = tokens * G;
    const int64_t rows_pad = (rows + kTileRows - 1) / kTileRows * kTileRows;
    const int64_t offset = arg.cached[it.seq];
    const int64_t* table = arg.tables + it.seq * arg.table_stride;
    // row (t, g) of the tile is query token t, head g of the group; the rows past it are zeros
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qpack.data() + (t * G + g) * D,
                    arg.q_row(it.seq, it.begin + t, it.head * G + g), D * sizeof(BFloat16));
    std::fill(qpack.begin() + rows * D, qpack.begin() + rows_pad * D, BFloat16(0.f));
    std::fill(ppack.begin() + rows * KP, ppack.begin() + rows_pad * KP, BFloat16(0.f));
    reset_rows(maxes, sums, acc, rows, rows_pad * D);
    const int64_t last_key = offset + it.end;  // keys [0, last_key) are visible to some row
    for (int64_t k0 = 0; k0 < last_key; k0 += arg.key_tile) {
      const int64_t keys = std::min(arg.key_tile, last_key - k0);
      const int64_t keys_pad = (keys + 63) / 64 * 64;  // whole groups of four key tiles
      pack_rows(kpack.data(), arg.cache, table, c, it.head, k0, k0 + keys);
      pack_rows(vpack.data(), arg.cache + c.value_offset, table, c, it.head, k0, k0 + keys);
      std::fill(kpack.begin() + keys * D, kpack.begin() + keys_pad * D, BFloat16(0.f));
      std::fill(vpack.begin() + keys * D, vpack.begin() + keys_pad * D, BFloat16(0.f));
      pack_keys_amx(kpack.data(), keys_pad, D, kt.data());
      pack_values_amx(vpack.data(), keys_pad, D, vt.data());
      // scores[rows, keys] = q . k^T, unscaled: four tiles of 16 keys at a time, so that four
      // products are in flight (one tile's chain waits out each product's latency)
      for (int64_t r0 = 0; r0 < rows_pad; r0 += kTileRows)
        for (int64_t j = 0; j < keys_pad / 16; j += 4) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t b = 0; b < D / 32; ++b) {
            const BFloat16* k = kt.data() + (j * (D / 32) + b) * 512;
            const int64_t next = D / 32 * 512;  // the next 16 keys' tile of these values
            _tile_loadd(4, qpack.data() + r0 * D + 32 * b, D * sizeof(BFloat16));
            _tile_loadd(6, k, kTileBytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, k + next, kTileBytes);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, k + 2 * next, kTileBytes);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, k + 3 * next, kTileBytes);
            _tile_dpbf16ps(3, 4, 7);
          }
          float* dst = scores.data() + r0 * KP + 16 * j;
          _tile_stored(0, dst, KP * sizeof(float));
          _tile_stored(1, dst + 16, KP * sizeof(float));
          _tile_stored(2, dst + 32, KP * sizeof(float));
          _tile_stored(3, dst + 48, KP * sizeof(float));
        }
      // the online softmax in two passes over each row's unscaled scores: the running max
      // (keys after the query's own position hidden first), then 2^((s - max) * c), summed
      // and rounded to bfloat16 (vcvtneps2bf16, as at::vec rounds) into the row of p
      const bool diagonal = k0 + keys > offset + it.begin + 1;
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * KP;
        BFloat16* p = ppack.data() + r * KP;
        if (diagonal) {
          const int64_t visible = offset + it.begin + r / G + 1 - k0;
          for (int64_t k = std::max<int64_t>(visible, 0); k < keys; ++k) s[k] = kNegInf;
        }
        __m512 mv = _mm512_set1_ps(maxes[r]);
        int64_t k = 0;
        for (; k + 16 <= keys; k += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + k));
        if (k < keys)
          mv = _mm512_mask_max_ps(mv, (__mmask16)((1u << (keys - k)) - 1), mv,
                                  _mm512_loadu_ps(s + k));
        const float m = _mm512_reduce_max_ps(mv);
        if (m == kNegInf) {  // nothing visible yet in this row: it adds nothing
          std::fill(p, p + keys_pad, BFloat16(0.f));
          continue;
        }
        const float rescale = std::exp2((maxes[r] - m) * w.c);
        const __m512 cv = _mm512_set1_ps(w.c), mc = _mm512_set1_ps(m * w.c);
        __m512 sum = _mm512_setzero_ps();
        for (k = 0; k < keys_pad; k += 16) {
          const __mmask16 live = k + 16 <= keys ? (__mmask16)0xffff
                                 : k < keys ? (__mmask16)((1u << (keys - k)) - 1)
                                            : (__mmask16)0;
          const __m512 e = _mm512_maskz_mov_ps(
              live, exp2_lanes(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s + k), cv, mc)));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[r] = sums[r] * rescale + _mm512_reduce_add_ps(sum);
        maxes[r] = m;
        scale_row(acc.data() + r * D, rescale, D);
      }
      // acc[rows, D] += p[rows, keys] . v[keys, D]: four tiles of 16 head-dim values at a time
      for (int64_t r0 = 0; r0 < rows_pad; r0 += kTileRows)
        for (int64_t b = 0; b < D / 16; b += 4) {
          float* a = acc.data() + r0 * D + 16 * b;
          _tile_loadd(0, a, D * sizeof(float));
          _tile_loadd(1, a + 16, D * sizeof(float));
          _tile_loadd(2, a + 32, D * sizeof(float));
          _tile_loadd(3, a + 48, D * sizeof(float));
          for (int64_t j = 0; j < keys_pad / 32; ++j) {
            const BFloat16* v = vt.data() + (j * (D / 16) + b) * 512;
            _tile_loadd(4, ppack.data() + r0 * KP + 32 * j, KP * sizeof(BFloat16));
            _tile_loadd(6, v, kTileBytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, v + 512, kTileBytes);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, v + 1024, kTileBytes);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, v + 1536, kTileBytes);
            _tile_dpbf16ps(3, 4, 7);
          }
          _tile_stored(0, a, D * sizeof(float));
          _tile_stored(1, a + 16, D * sizeof(float));
          _tile_stored(2, a + 32, D * sizeof(float));
          _tile_stored(3, a + 48, D * sizeof(float));
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / G, g = r % G;
      float* a = acc.data() + r * D;
      scale_row(a, 1.f / sums[r], D);
      store(arg.out_row(it.seq, it.begin + t, it.head * G + g), a, D);
    }
  }
  _tile_release();
}

void prefill_kernel_amx(const at::Tensor& q, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                        const at::Tensor& num_cached, double scale, at::Tensor& out) {
  PrefillArgs<BFloat16> arg(q, kv_cache, block_tables, query_start_loc, num_cached, out);
  // query rows per tile, twice prefill_kernel's: each tile packs every key tile it sees, and
  // the products here are cheap beside that (against 128 and 256 rows: 1.04-1.17x for 952 to
  // 2048 tokens over 0 to 2048 cached, 0.93-0.99x for 256 tokens, 1 and 2 threads)
  arg.tokens_per_tile = std::max<int64_t>(1, 2 * kQueryRows / arg.G);
  const int64_t long_tile = std::max<int64_t>(1, 2 * kQueryRowsLong / arg.G);
  std::vector<int64_t> costs;
  const std::vector<PrefillItem> items = prefill_items(arg, block_tables.size(1), long_tile, costs);
  int64_t tokens_max = 1;  // the tallest tile of this call: its buffers, no taller
  for (const PrefillItem& it : items) tokens_max = std::max(tokens_max, it.end - it.begin);
  const AmxPrefill work{arg, items, (arg.key_tile + 63) / 64 * 64,
                        (tokens_max * arg.G + kTileRows - 1) / kTileRows * kTileRows,
                        static_cast<float>(scale * M_LOG2E)};
  parallel_by_cost(costs, [&](int64_t i_begin, int64_t i_end) {
    prefill_items_amx(work, i_begin, i_end);
  });
}
#endif


}  // namespace

PDSERVE_ISA_END

// ---- the ops: checks and dispatch, compiled for any CPU ----

namespace PDSERVE_OPS {

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: a contiguous [2, num_blocks, block_size, kv_heads, head_dim]");
}

// What both attention ops check of their query, cache, output and scale (the prefill kernels
// keep their running maxima times the scale, so it must be positive).
void check_common(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& out,
                  double scale) {
  TORCH_CHECK(q.device().is_cpu(), "CPU tensors expected");
  check_cache(kv_cache);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kv_cache.size(4) && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q: [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == q.size(2),
              "out: q's shape with contiguous heads");
  TORCH_CHECK(scale > 0, "the attention scale must be positive");
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, at::Tensor out) {
  check_common(q, kv_cache, out, scale);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == q.size(0) &&
                  block_tables.size(0) == q.size(0),
              "block_tables [batch, max_blocks] and seq_lens [batch], int64");
  if (q.size(0) == 0) return;
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 expected");
  const bool fp32 = q.scalar_type() == at::kFloat;
  switch (q.size(2)) {
    case 64:
      return fp32 ? decode_kernel<float, 64>(q, kv_cache, block_tables, seq_lens, scale, out)
                  : decode_kernel<BFloat16, 64>(q, kv_cache, block_tables, seq_lens, scale, out);
    case 128:
      return fp32 ? decode_kernel<float, 128>(q, kv_cache, block_tables, seq_lens, scale, out)
                  : decode_kernel<BFloat16, 128>(q, kv_cache, block_tables, seq_lens, scale, out);
    default:
      return fp32 ? decode_kernel<float, 0>(q, kv_cache, block_tables, seq_lens, scale, out)
                  : decode_kernel<BFloat16, 0>(q, kv_cache, block_tables, seq_lens, scale, out);
  }
}

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& num_cached, double scale, int64_t gemm,
                             at::Tensor out) {
  check_common(q, kv_cache, out, scale);
  const int64_t n = num_cached.size(0);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == n &&
                  query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == n + 1 &&
                  num_cached.scalar_type() == at::kLong && num_cached.is_contiguous(),
              "block_tables [seqs, max_blocks], query_start_loc [seqs + 1], num_cached [seqs], "
              "int64");
  if (n == 0) return;
  if (q.scalar_type() == at::kFloat) {
#if PDSERVE_ISA != 0
    return prefill_kernel_lanes<float>(q, kv_cache, block_tables, query_start_loc, num_cached,
                                       scale, out);
#endif
    prefill_kernel<float, float>(q, kv_cache, block_tables, query_start_loc, num_cached, scale,
                                 out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 expected");
#if PDSERVE_AMX_BUILD
    if (gemm == 3 && amx_runs(q.size(2)))
      return prefill_kernel_amx(q, kv_cache, block_tables, query_start_loc, num_cached, scale,
                                out);
#endif
#if PDSERVE_ISA == 2
    if (gemm == 2 && dp_runs(q.size(2)))
      return prefill_kernel_dp(q, kv_cache, block_tables, query_start_loc, num_cached, scale,
                               out);
#endif
    // MKL's bfloat16 GEMM: asked for, or where AMX's tiles cannot run
    const bool mkl = (gemm == 1 || gemm == 3) && blas().bgemm;
#if PDSERVE_ISA != 0
    if (!mkl)  // tiles widened to float
      return prefill_kernel_lanes<BFloat16>(q, kv_cache, block_tables, query_start_loc,
                                            num_cached, scale, out);
#endif
    if (mkl)
      prefill_kernel<BFloat16, BFloat16>(q, kv_cache, block_tables, query_start_loc, num_cached,
                                         scale, out);
    else
      prefill_kernel<BFloat16, float>(q, kv_cache, block_tables, query_start_loc, num_cached,
                                      scale, out);
  }
}

// kv_cache[0 / 1] at slot slot_mapping[t] = key / value row t (reference.write_kv): each row
// copied whole, once, straight from where the projection left it; torch's index_copy_ took
// about 3x as long for a step's rows (60, 316 or 2048 rows of 4 x 64 floats, one thread).
// Every slot is checked first: a bad plan writes nothing.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  const int64_t tokens = slot_mapping.size(0);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == tokens &&
                    t->size(1) == kv_cache.size(3) && t->size(2) == kv_cache.size(4) &&
                    t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) && t->scalar_type() == kv_cache.scalar_type(),
                "key, value: [tokens, kv_heads, head_dim] rows of the cache's dtype, each row "
                "contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "slot_mapping: [tokens] int64");
  const Cache c = describe(kv_cache);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = c.num_blocks * c.block_size;
  for (int64_t t = 0; t < tokens; ++t)
    PDSERVE_CHECK(slots[t] >= 0 && slots[t] < num_slots,
                  "slot %lld of token %lld is outside the cache's %lld slots",
                  static_cast<long long>(slots[t]), static_cast<long long>(t),
                  static_cast<long long>(num_slots));
  const int64_t bytes = c.row_stride * kv_cache.element_size();
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size();
  const int64_t vs = value.stride(0) * value.element_size();
  const int64_t v_off = c.value_offset * kv_cache.element_size();
  pdserve_pool::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      char* dst = cache + slots[t] * bytes;
      std::memcpy(dst, k + t * ks, bytes);
      std::memcpy(dst + v_off, v + t * vs, bytes);
    }
  });
}

}  // namespace PDSERVE_OPS
