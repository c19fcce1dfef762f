// The sampler's exponential race on the CPU: one token per row, argmax over i of p[i] / E[i]
// with E[i] ~ Exp(1), which draws i with probability p[i] / sum(p). Given logits instead, the
// weights are exp(x[i] - max x), made in passing: the softmax is never written out.
//
// The noise is a function of the row's 64-bit key and i alone (a counter-based generator: two
// rounds of a 32-bit integer hash), so a row's draw does not depend on the rows beside it or
// the thread count; builds for other instruction sets round E and exp differently in the last
// bits, which changes a draw only on a near-tie. E = -log(U), U uniform on (0, 1) on a grid of
// 2^23 points (each exact in float), its log by range reduction to [sqrt(1/2), sqrt(2)) and a
// series (error about 1e-10, so E stays accurate as U -> 1); a row is walked in chunks that
// stay in L1: the noise of a chunk first (a plain loop the compiler vectorises), then p / E and
// a running argmax in vectors. Ties go to the lowest index, as torch.argmax. Rows run in
// parallel.
//
// kernels/reference.py: exponential_race computes the same draw with torch ops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"
#include "vec_helpers.h"

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();
constexpr int64_t kChunk = 1024;  // noise drawn per pass

// lowbias32 (a 32-bit integer hash with near-ideal avalanche)
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// 32 random bits for element i of the row keyed by `key`
inline uint32_t random_bits(uint64_t key, uint32_t i) {
  return mix32(mix32(i ^ static_cast<uint32_t>(key)) + static_cast<uint32_t>(key >> 32));
}

// -log(u) for u in (0, 1): u = m * 2^e with m in [sqrt(1/2), sqrt(2)) (for u near 1, e = 0 and
// m - 1 is exact), log(m) = 2 atanh(s), s = (m-1)/(m+1) in (-0.172, 0.172), by its series to
// s^11
inline float neg_log(float u) {
  uint32_t bits;
  std::memcpy(&bits, &u, 4);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127);
  bits = (bits & 0x007fffffU) | 0x3f800000U;
  float m;
  std::memcpy(&m, &bits, 4);
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  e = high ? e + 1.f : e;
  const float s = (m - 1.f) / (m + 1.f), s2 = s * s;
  const float log_m =
      s * (2.f + s2 * (2.f / 3 + s2 * (2.f / 5 + s2 * (2.f / 7 + s2 * (2.f / 9 + s2 * (2.f / 11))))));
  return -(e * 0.6931471805599453f + log_m);
}

// E for elements [begin, begin + n) of the row keyed by `key`
inline void exponential_noise(uint64_t key, int64_t begin, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bits = random_bits(key, static_cast<uint32_t>(begin + j));
    // the top 23 bits, centred in their interval: k + 0.5 < 2^23 is exact in float, so u is in
    // (0, 1), never 0 or 1
    const float u = (static_cast<float>(static_cast<int32_t>(bits >> 9)) + 0.5f) *
                    (1.f / 8388608.f);
    out[j] = neg_log(u);
  }
}

// With `logits`, p holds log-weights: the weights are exp(p - max p), computed in passing.
int64_t race_row(const float* p, int64_t vocab, uint64_t key, bool logits) {
  float noise[kChunk];
  const float shift = logits ? row_max(p, vocab) : 0.f;
  if (logits && !std::isfinite(shift))  // a +inf logit is certain; a row all -inf gives 0
    return std::find(p, p + vocab, shift) - p;
  const fVec shift_v(shift);
  float best_value = -1.f;
  int64_t best_index = 0;
  for (int64_t begin = 0; begin < vocab; begin += kChunk) {
    const int64_t n = std::min(kChunk, vocab - begin);
    exponential_noise(key, begin, n, noise);
    // lanes keep their first maximum; indices travel as floats (exact below 2^24)
    fVec best(-1.f), best_at(0.f), at_lane = fVec::arange(0.f, 1.f);
    int64_t j = 0;
    for (; j + kVec <= n; j += kVec, at_lane = at_lane + fVec(static_cast<float>(kVec))) {
      fVec w = fVec::loadu(p + begin + j);
      if (logits) w = (w - shift_v).exp_u20();
      const fVec score = w / fVec::loadu(noise + j);
      const fVec better = score > best;
      best = fVec::blendv(best, score, better);
      best_at = fVec::blendv(best_at, at_lane, better);
    }
    float lane_value[kVec], lane_at[kVec];
    best.store(lane_value);
    best_at.store(lane_at);
    for (int64_t l = 0; l < kVec; ++l) {
      const int64_t at = begin + static_cast<int64_t>(lane_at[l]);
      if (lane_value[l] > best_value || (lane_value[l] == best_value && at < best_index)) {
        best_value = lane_value[l];
        best_index = at;
      }
    }
    for (; j < n; ++j) {  // the chunk's tail, after every vector of it
      const float w = logits ? std::exp(p[begin + j] - shift) : p[begin + j];
      const float score = w / noise[j];
      if (score > best_value) {
        best_value = score;
        best_index = begin + j;
      }
    }
  }
  return best_index;
}

}  // namespace

PDSERVE_ISA_END

namespace {

// probs: [rows, vocab] float32 (rows need not sum to 1), or with `logits` log-weights;
// keys: [rows] int64; out: [rows] int64
void exponential_race(const at::Tensor& probs, const at::Tensor& keys, bool logits,
                      at::Tensor out) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 &&
                  probs.stride(1) == 1,
              "probs: a float32 [rows, vocab] CPU tensor with contiguous rows");
  TORCH_CHECK(probs.size(1) <= (int64_t{1} << 31), "a vocabulary of at most 2^31 tokens");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.is_contiguous() &&
                  keys.size(0) == probs.size(0),
              "keys: int64 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                  out.size(0) == probs.size(0),
              "out: int64 [rows]");
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t vocab = probs.size(1), stride = probs.stride(0);
  at::parallel_for(0, probs.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = race_row(p + r * stride, vocab, static_cast<uint64_t>(k[r]), logits);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PDSERVE_OPS, m) {
  m.def("exponential_race(Tensor probs, Tensor keys, bool logits, Tensor(a!) out) -> ()");
  m.impl("exponential_race", c10::DispatchKey::CPU, &exponential_race);
}
