"""What a paired, heads-major KV block layout would buy the bfloat16 decode attention, measured
before any of the serving path changes: a one-thread probe kernel on that layout beside the
served kernel on today's, the same contexts, cache-resident and scattered over 8 layers' caches.

    .venv/bin/python benchmarks/layout_probe.py [--reps 21]

Today a block is [slot][kv head][head dim]: the key pass multiplies a position's key row against
the query in 32-value pairs and must then sum each product vector's 16 lanes (lane_sums), and
the value pass interleaves two positions' rows into pairs before it multiplies them. In the
probe's layout a block is, per kv head, keys as [head-dim pair][slot][2] (one 64-byte vector
holds pair d of all 16 slots: 32 vdpbf16ps against the query's broadcast pairs give the 16
slots' scores whole) and values as [slot pair][head dim][2] (a vector holds 16 head-dim values
of two slots, multiplied as they lie against the two slots' weights). The probe has the same
passes as the served kernel (scores, softmax, weights rounded to bfloat16, values) and asks for
the kv head's part of the block six on (keys and values in the key pass, values in the value
pass); it is single-threaded, head_dim 64, blocks of 16, an even number of query heads per kv
head, and exists only here. Prints ns per position and kv head of each, their ratio, and the largest
difference between their outputs; over scattered blocks also the served float32 kernel on the
same contexts, and bfloat16's read rate per byte over float32's for the served kernel and the
probe (the attention benchmark's rule: at least 1).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import (  # noqa: E402
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    cpu_flags,
    median_quartiles,
    scattered_decode,
    timed,
)
from kernels.cpu_attention import paged_decode_attention  # noqa: E402

BATCH = 64

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#define PROBE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace {
constexpr int kBS = 16, kD = 64, kPairs = kD / 2;
constexpr int64_t kAhead = 6;  // blocks of a kv head's part (2 KiB each) asked for ahead

inline void ahead(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

PROBE inline __m512bh pair(const uint16_t* x) {  // two bfloat16 broadcast as one word
  uint32_t w;
  std::memcpy(&w, x, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
}

// exp of 16 lanes: 2^n (scalef) times a degree-6 polynomial of 2^f, f in [-0.5, 0.5]
PROBE inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// keys [nb][kvh][kPairs][kBS][2], values [nb][kvh][kBS / 2][kD][2], q [B][H][kD] bfloat16;
// out [B][H][kD] float.
PROBE void decode(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                  const torch::Tensor& tables, const torch::Tensor& lens, double scale,
                  torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), KVH = keys.size(1), G = H / KVH;
  const int64_t kstride = KVH * kPairs * kBS * 2, vstride = KVH * (kBS / 2) * kD * 2;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(values.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t tstride = tables.stride(0);
  std::vector<float> scores;
  std::vector<uint16_t> weights;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lp[b], nblk = (n + kBS - 1) / kBS, padded = nblk * kBS;
    const int64_t* table = tp + b * tstride;
    scores.assign(H * padded, 0.f);
    weights.assign(H * padded, 0);
    const __m512 sc = _mm512_set1_ps(static_cast<float>(scale));
    // keys: each kv head's blocks in turn, 16 slots' scores per block whole
    for (int64_t h = 0; h < KVH; ++h) {
      const uint16_t* qh = qp + (b * H + h * G) * kD;
      for (int64_t i = 0; i < nblk; ++i) {
        if (i + kAhead < nblk) {  // the kv head's keys and values of the block kAhead on
          const int64_t next = table[i + kAhead];
          ahead(kp + next * kstride + h * kPairs * kBS * 2, kPairs * kBS * 4);
          ahead(vp + next * vstride + h * (kBS / 2) * kD * 2, kBS * kD * 2);
        }
        const uint16_t* k = kp + table[i] * kstride + h * kPairs * kBS * 2;
        for (int64_t g = 0; g < G; g += 2) {  // two heads at a time (G even)
          // two chains a head, so the products do not wait on each other's latency
          const uint16_t* q0 = qh + g * kD;
          const uint16_t* q1 = q0 + kD;
          __m512 x0 = _mm512_setzero_ps(), y0 = x0, x1 = x0, y1 = x0;
#pragma GCC unroll 16
          for (int d = 0; d < kPairs; d += 2) {
            const __m512bh ka = (__m512bh)_mm512_loadu_si512(k + d * kBS * 2);
            const __m512bh kb = (__m512bh)_mm512_loadu_si512(k + (d + 1) * kBS * 2);
            x0 = _mm512_dpbf16_ps(x0, ka, pair(q0 + 2 * d));
            y0 = _mm512_dpbf16_ps(y0, kb, pair(q0 + 2 * d + 2));
            x1 = _mm512_dpbf16_ps(x1, ka, pair(q1 + 2 * d));
            y1 = _mm512_dpbf16_ps(y1, kb, pair(q1 + 2 * d + 2));
          }
          _mm512_storeu_ps(scores.data() + (h * G + g) * padded + i * kBS,
                           _mm512_mul_ps(_mm512_add_ps(x0, y0), sc));
          _mm512_storeu_ps(scores.data() + (h * G + g + 1) * padded + i * kBS,
                           _mm512_mul_ps(_mm512_add_ps(x1, y1), sc));
        }
      }
    }
    // softmax per query head; weights rounded to bfloat16, zeros past n
    std::vector<float> sums(H);
    for (int64_t hq = 0; hq < H; ++hq) {
      float* s = scores.data() + hq * padded;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      int64_t j0 = 0;
      for (; j0 + 16 <= n; j0 += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j0));
      float m = _mm512_reduce_max_ps(mx);
      for (; j0 < n; ++j0) m = std::max(m, s[j0]);
      float sum = 0.f;
      const __m512 mv = _mm512_set1_ps(m);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        const __m512 x = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        sum += _mm512_reduce_add_ps(x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights.data() + hq * padded + j),
                            (__m256i)_mm512_cvtneps_pbh(x));
      }
      for (; j < n; ++j) {
        const float e = std::exp(s[j] - m);
        sum += e;
        const __m512 x = _mm512_set1_ps(e);
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
        weights[hq * padded + j] = static_cast<uint16_t>(_mm256_extract_epi16(r, 0));
      }
      sums[hq] = sum;
    }
    // values: each kv head's blocks in turn, G heads' accumulators in registers
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t g = 0; g < G; g += 2) {  // two heads at a time (G even)
        __m512 a[2][4];
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x)
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) a[x][c] = _mm512_setzero_ps();
        const uint16_t* w0 = weights.data() + (h * G + g) * padded;
        const uint16_t* w1 = w0 + padded;
        for (int64_t i = 0; i < nblk; ++i) {
          if (i + kAhead < nblk)
            ahead(vp + table[i + kAhead] * vstride + h * (kBS / 2) * kD * 2, kBS * kD * 2);
          const uint16_t* v = vp + table[i] * vstride + h * (kBS / 2) * kD * 2;
          for (int sp = 0; sp < kBS / 2; ++sp) {
            const __m512bh p0 = pair(w0 + i * kBS + 2 * sp), p1 = pair(w1 + i * kBS + 2 * sp);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
              const __m512bh x = (__m512bh)_mm512_loadu_si512(v + sp * kD * 2 + c * 32);
              a[0][c] = _mm512_dpbf16_ps(a[0][c], x, p0);
              a[1][c] = _mm512_dpbf16_ps(a[1][c], x, p1);
            }
          }
        }
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x) {
          const __m512 inv = _mm512_set1_ps(1.f / sums[h * G + g + x]);
          float* o = op + (b * H + h * G + g + x) * kD;
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(a[x][c], inv));
        }
      }
    }
  }
}
}  // namespace

torch::Tensor probe_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(2) == kD && keys.size(3) == kBS &&
              (q.size(1) / keys.size(1)) % 2 == 0);
  auto out = torch::empty(q.sizes(), q.options().dtype(at::kFloat));
  decode(q, keys, values, tables, lens, scale, out);
  return out;
}
"""


def paired(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's [2, blocks, slot, kv head, dim] cache in the probe's layout: keys
    [blocks, kv head, dim pair, slot, 2], values [blocks, kv head, slot pair, dim, 2]."""
    nb, bs, kvh, d = cache.shape[1:]
    keys = cache[0].view(nb, bs, kvh, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    values = cache[1].view(nb, bs // 2, 2, kvh, d).permute(0, 3, 1, 4, 2).contiguous()
    return keys, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = load_inline("layout_probe", cpp_sources=SOURCE, functions=["probe_decode"],
                      extra_cflags=["-O3"], verbose=False)
    print(f"CPU flags: {cpu_flags()}; bfloat16, one thread, {BATCH} sequences, 8 query heads / "
          f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}, blocks of {BLOCK}")
    gen = torch.Generator().manual_seed(0)
    for ctx in (320, 2000):
        compare(lib, ctx, args.reps, gen)


def compare(lib, ctx: int, reps: int, gen: torch.Generator) -> None:
    """Both kernels on BATCH sequences of ctx positions: resident, then scattered (there with
    the served float32 kernel on the same contexts in float32 alternated too, for bfloat16's
    read rate per byte against float32's, call by call)."""
    scale = HEAD_DIM ** -0.5
    q, caches, tables, lens = scattered_decode([ctx] * BATCH, torch.bfloat16, gen)
    probes = [paired(c) for c in caches]
    want = paged_decode_attention(q, caches[0], tables, lens, scale).float()
    got = lib.probe_decode(q, *probes[0], tables, lens, scale)
    diff = (got - want).abs().max().item()
    # resident: every sequence reads layer 0's blocks of sequence 0
    rt = tables[:1].expand_as(tables).contiguous()
    cases = {"resident": (lambda: paged_decode_attention(q, caches[0], rt, lens, scale),
                          lambda: lib.probe_decode(q, *probes[0], rt, lens, scale), None)}
    t1, t2, t3 = itertools.count(), itertools.count(), itertools.count()
    floats, qf = [c.float() for c in caches], q.float()
    cases["scattered"] = (
        lambda: paged_decode_attention(q, caches[next(t1) % len(caches)], tables, lens, scale),
        lambda: lib.probe_decode(q, *probes[next(t2) % len(probes)], tables, lens, scale),
        lambda: paged_decode_attention(qf, floats[next(t3) % len(floats)], tables, lens, scale))
    per = BATCH * ctx * KV_HEADS * 1e-9
    for name, (served, probe, f32) in cases.items():
        a, b, f = [], [], []
        for _ in range(reps):  # alternated call by call
            a += timed(served, 1)
            b += timed(probe, 1)
            if f32 is not None:
                f += timed(f32, 1)
        sa, sb = statistics.median(a) / per, statistics.median(b) / per
        line = (f"{name:9s} 64x{ctx:<5d} served {sa:6.1f} ns "
                f"[{min(a) / per:.1f}-{max(a) / per:.1f}]  probe {sb:6.1f} ns "
                f"[{min(b) / per:.1f}-{max(b) / per:.1f}]  served/probe {sa / sb:.2f}x  "
                f"max diff {diff:.1e}")
        if f:
            line += (f"\n          float32 served {statistics.median(f) / per:6.1f} ns; "
                     f"bfloat16 per byte over float32 (pair by pair): served "
                     f"{per_byte(f, a)}, probe {per_byte(f, b)}")
        print(line, flush=True)


def per_byte(f32: list[float], bf16: list[float]) -> str:
    """Median [quartiles] of bfloat16's read rate over float32's, call pair by call pair (a
    bfloat16 call reads half the bytes)."""
    return median_quartiles([f / (2 * b) for f, b in zip(f32, bf16)])


if __name__ == "__main__":
    main()
