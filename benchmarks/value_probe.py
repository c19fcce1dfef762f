"""The decode value pass alone, on today's value rows and on values paired by positions, beside
float32's: whether pairing the value rows would make bfloat16's value pass at most half of
float32's (with the key pass bound by memory, bfloat16 is as fast per byte as float32 only then;
docs/bench/issue21-zen5-2026-12-02-s46/kernel_experiments.txt, 7).

    .venv/bin/python benchmarks/value_probe.py [--reps 21] [--ctx 320]

One thread, 64 sequences, 8 query heads / 4 kv heads, head_dim 64, blocks of 16, every sequence
on the same blocks (cache-resident: the value pass runs from L2 in the served kernel, after the
key pass asked for its rows). Three loops over the same weights, calls alternated:
- bfloat16 rows as the cache holds them ([slot][kv head][dim]): two positions' rows interleaved
  into pairs (unpack), multiplied against the pair of weights (vdpbf16ps), as the served kernel's
  pairs_axpy_dp;
- bfloat16 values paired by positions ([slot pair][kv head][dim][2]): loaded as they lie;
- float32 rows: one FMA per 16 values and weight, as the served kernel's rows_axpy.
Prints ns per position and kv head of each, and float32's over each bfloat16 one (>= 2 is what
rule 2 needs), and the largest difference of the paired loop's output from the unpacked one's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, cpu_flags  # noqa: E402

BATCH = 64

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <cstring>

#define PROBE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace {
constexpr int kBS = 16, kD = 64, kG = 2;

PROBE inline __m512bh pair(const uint16_t* x) {  // two bfloat16 broadcast as one word
  uint32_t w;
  std::memcpy(&w, x, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
}

// rows [nb][kBS][kvh][kD] bfloat16; w [B][H][n] bfloat16 (n even); out [B][H][kD] float, in
// the unpacked order (lanes of 4 from each row's half of 8, as pairs_axpy_dp leaves them)
PROBE void unpacked(const uint16_t* rows, const uint16_t* w, const int64_t* table, int64_t B,
                    int64_t KVH, int64_t n, float* out) {
  const int64_t H = KVH * kG, row = KVH * kD;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h) {
      __m512 a[kG][4];
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
      const uint16_t* wh = w + (b * H + h * kG) * n;
      for (int64_t p = 0; p < n; p += 2) {
        const uint16_t* x = rows + (table[p / kBS] * kBS + p % kBS) * row + h * kD;
        const uint16_t* y = x + row;  // p even, kBS even: p + 1 is in the same block
        __m512i lo[2], hi[2];
        for (int c = 0; c < 2; ++c) {
          const __m512i xv = _mm512_loadu_si512(x + 32 * c), yv = _mm512_loadu_si512(y + 32 * c);
          lo[c] = _mm512_unpacklo_epi16(xv, yv);
          hi[c] = _mm512_unpackhi_epi16(xv, yv);
        }
        for (int g = 0; g < kG; ++g) {
          const __m512bh wv = pair(wh + g * n + p);
          for (int c = 0; c < 2; ++c) {
            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo[c], wv);
            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi[c], wv);
          }
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(out + ((b * H + h * kG + g) * kD) + 16 * c, a[g][c]);
    }
}

// values [nb][kBS / 2][kvh][kD][2] bfloat16: a vector is 16 head-dim values of two positions;
// out in the head dim's order
PROBE void paired(const uint16_t* vals, const uint16_t* w, const int64_t* table, int64_t B,
                  int64_t KVH, int64_t n, float* out) {
  const int64_t H = KVH * kG, pair_row = KVH * kD * 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h) {
      __m512 a[kG][4];
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
      const uint16_t* wh = w + (b * H + h * kG) * n;
      for (int64_t p = 0; p < n; p += 2) {
        const uint16_t* v = vals + (table[p / kBS] * (kBS / 2) + (p % kBS) / 2) * pair_row +
                            h * kD * 2;
        __m512bh x[4];
        for (int c = 0; c < 4; ++c) x[c] = (__m512bh)_mm512_loadu_si512(v + 32 * c);
        for (int g = 0; g < kG; ++g) {
          const __m512bh wv = pair(wh + g * n + p);
          for (int c = 0; c < 4; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], x[c], wv);
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(out + ((b * H + h * kG + g) * kD) + 16 * c, a[g][c]);
    }
}

// rows [nb][kBS][kvh][kD] float; w [B][H][n] float
PROBE void float_rows(const float* rows, const float* w, const int64_t* table, int64_t B,
                      int64_t KVH, int64_t n, float* out) {
  const int64_t H = KVH * kG, row = KVH * kD;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h) {
      __m512 a[kG][4];
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
      const float* wh = w + (b * H + h * kG) * n;
      for (int64_t p = 0; p < n; ++p) {
        const float* x = rows + (table[p / kBS] * kBS + p % kBS) * row + h * kD;
        __m512 xv[4];
        for (int c = 0; c < 4; ++c) xv[c] = _mm512_loadu_ps(x + 16 * c);
        for (int g = 0; g < kG; ++g) {
          const __m512 wv = _mm512_set1_ps(wh[g * n + p]);
          for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(wv, xv[c], a[g][c]);
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(out + ((b * H + h * kG + g) * kD) + 16 * c, a[g][c]);
    }
}
}  // namespace

void value_pass(int64_t kind, torch::Tensor values, torch::Tensor weights, torch::Tensor table,
                torch::Tensor out) {
  const int64_t B = weights.size(0), KVH = weights.size(1) / kG, n = weights.size(2);
  TORCH_CHECK(n % 2 == 0 && weights.size(1) % kG == 0 && out.size(2) == kD);
  const int64_t* t = table.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  if (kind == 2) {
    float_rows(values.data_ptr<float>(), weights.data_ptr<float>(), t, B, KVH, n, o);
    return;
  }
  const auto* v = reinterpret_cast<const uint16_t*>(values.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weights.data_ptr());
  if (kind == 0) unpacked(v, w, t, B, KVH, n, o);
  else paired(v, w, t, B, KVH, n, o);
}
"""


def unpair(x: torch.Tensor) -> torch.Tensor:
    """The unpacked loop's head-dim order back to the head dim's (as unpair_acc does)."""
    out = torch.empty_like(x)
    for b in range(0, HEAD_DIM, 32):
        for i in range(16):
            d = b + 8 * (i // 4) + i % 4
            out[..., d] = x[..., b + i]
            out[..., d + 4] = x[..., b + 16 + i]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--ctx", type=int, default=320)
    args = ap.parse_args()
    assert HEADS // KV_HEADS == 2 and args.ctx % BLOCK == 0
    torch.set_num_threads(1)
    lib = load_inline("value_probe", cpp_sources=SOURCE, functions=["value_pass"],
                      extra_cflags=["-O3"], verbose=False)
    gen = torch.Generator().manual_seed(0)
    blocks, n = args.ctx // BLOCK, args.ctx
    rows = torch.randn((blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    pairs = rows.view(blocks, BLOCK // 2, 2, KV_HEADS, HEAD_DIM).permute(0, 1, 3, 4, 2)
    table = torch.randperm(blocks, generator=gen)  # every sequence on the same blocks
    w = torch.rand((BATCH, HEADS, n), generator=gen)
    inputs = {
        "bfloat16 rows, unpacked": (0, rows.bfloat16(), w.bfloat16()),
        "bfloat16 paired values": (1, pairs.contiguous().bfloat16(), w.bfloat16()),
        "float32 rows": (2, rows, w),
    }
    outs = {k: torch.empty((BATCH, HEADS, HEAD_DIM)) for k in inputs}
    times: dict[str, list[float]] = {k: [] for k in inputs}
    for _ in range(args.reps):  # alternated call by call
        for name, (kind, vals, weights) in inputs.items():
            start = time.perf_counter()
            lib.value_pass(kind, vals, weights, table, outs[name])
            times[name].append(time.perf_counter() - start)
    diff = (unpair(outs["bfloat16 rows, unpacked"]) - outs["bfloat16 paired values"]).abs().max()
    print(f"CPU flags: {cpu_flags()}; one thread, {BATCH} x {n} positions, {HEADS} query heads / "
          f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}, blocks of {BLOCK}, cache-resident; "
          f"{args.reps} calls each, alternated")
    per = BATCH * n * KV_HEADS * 1e-9
    med = {k: statistics.median(v) / per for k, v in times.items()}
    for name, t in med.items():
        print(f"{name:26s} {t:5.2f} ns/position/kv head [{min(times[name]) / per:.2f}-"
              f"{max(times[name]) / per:.2f}]   float32 / this {med['float32 rows'] / t:.2f}")
    print(f"paired against unpacked, largest difference: {diff:.1e}")


if __name__ == "__main__":
    main()
