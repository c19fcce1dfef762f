// The sampler's exponential race on the CPU: one token per row, argmax over i of p[i] / E[i]
// with E[i] ~ Exp(1), which draws i with probability p[i] / sum(p). Given logits instead, the
// weights are exp(x[i] - max x), made in passing: the softmax is never written out, nor the
// top_k / top_p / min_p mask (a row's cut: its logits below it weigh nothing).
//
// The noise is a function of the row's 64-bit key and i alone (a counter-based generator: two
// rounds of a 32-bit integer hash), so a row's draw does not depend on the rows beside it or
// the thread count; builds for other instruction sets round E and exp differently in the last
// bits, which changes a draw only on a near-tie. E = -log(U), U uniform on (0, 1) on a grid of
// 2^23 points (each exact in float), its log by range reduction to [sqrt(1/2), sqrt(2)) and a
// series (error about 1e-10, so E stays accurate as U -> 1). A row is walked a vector at a
// time: the hash, E, p / E and a running argmax all in vector registers (integer lanes for the
// hash, written with at::vec so that every build vectorises it; GCC does not vectorise the
// scalar form for AVX2), the scalar form only for the tail past the last whole vector. Ties go
// to the lowest index, as torch.argmax. Rows run in parallel.
//
// kernels/reference.py: exponential_race computes the same draw with torch ops.
//
// argmax_rows: torch.argmax over each row's last dim (the greedy rows' token), rows in
// parallel, vectorised (torch's own takes 2 ns per element on one AVX2 thread).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"
#include "ops.h"
#include "vec_helpers.h"

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();

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

// a row's vector lanes carry indices as floats, exact below 2^24: longer rows go in spans of it
constexpr int64_t kSpan = int64_t{1} << 24;

using iVec = at::vec::Vectorized<int32_t>;
static_assert(iVec::size() == kVec, "as many int32 lanes as float lanes");

// x >> k on unsigned 32-bit lanes (at::vec's >> on int32 shifts in the sign)
inline iVec shift_right(const iVec& x, int k) {
  return (x >> iVec(k)) & iVec(static_cast<int32_t>(0xffffffffU >> k));
}

inline iVec mix32(iVec x) {
  x = x ^ shift_right(x, 16);
  x = x * iVec(0x7feb352d);
  x = x ^ shift_right(x, 15);
  x = x * iVec(static_cast<int32_t>(0x846ca68bU));
  return x ^ shift_right(x, 16);
}

inline iVec float_bits(const fVec& v) {
#if PDSERVE_ISA == 2
  return _mm512_castps_si512(v);
#elif PDSERVE_ISA == 1
  return _mm256_castps_si256(v);
#else
  return at::vec::cast<int32_t>(v);
#endif
}

// neg_log on every lane, the scalar form's operations in its order
inline fVec neg_log(const fVec& u) {
  iVec bits = float_bits(u);
  fVec e = at::vec::convert_to_fp_of_same_size<float>(shift_right(bits, 23) - iVec(127));
  bits = (bits & iVec(0x007fffff)) | iVec(0x3f800000);
  fVec m = at::vec::cast<float>(bits);
  const fVec high = m > fVec(1.41421356f);
  m = fVec::blendv(m, m * fVec(0.5f), high);
  e = fVec::blendv(e, e + fVec(1.f), high);
  const fVec s = (m - fVec(1.f)) / (m + fVec(1.f)), s2 = s * s;
  const fVec log_m =
      s * (fVec(2.f) +
           s2 * (fVec(2.f / 3) +
                 s2 * (fVec(2.f / 5) +
                       s2 * (fVec(2.f / 7) + s2 * (fVec(2.f / 9) + s2 * fVec(2.f / 11))))));
  return (e * fVec(0.6931471805599453f) + log_m).neg();
}

// E for element i of the row keyed by `key`: U from the top 23 bits, centred in their
// interval (k + 0.5 < 2^23 is exact in float, so U is in (0, 1), never 0 or 1)
inline float exponential_noise(uint64_t key, uint32_t i) {
  const uint32_t bits = random_bits(key, i);
  return neg_log((static_cast<float>(static_cast<int32_t>(bits >> 9)) + 0.5f) *
                 (1.f / 8388608.f));
}

// the same for elements [begin, begin + kVec) of the row whose key halves are low, high
inline fVec exponential_noise(const iVec& low, const iVec& high, int32_t begin) {
  const iVec bits = mix32(mix32(iVec::arange(begin, 1) ^ low) + high);
  const fVec u = (at::vec::convert_to_fp_of_same_size<float>(shift_right(bits, 9)) + fVec(0.5f)) *
                 fVec(1.f / 8388608.f);
  return neg_log(u);
}

// Folds a span's lanes (each its largest value and that value's index from `span`, as a
// float) into (best_value, best_index): a larger value wins, an equal one at a lower index too.
inline void fold_lanes(const fVec& best, const fVec& best_at, int64_t span, float& best_value,
                       int64_t& best_index) {
  float lane_value[kVec], lane_at[kVec];
  best.store(lane_value);
  best_at.store(lane_at);
  for (int64_t l = 0; l < kVec; ++l) {
    const int64_t at = span + static_cast<int64_t>(lane_at[l]);
    if (lane_value[l] > best_value || (lane_value[l] == best_value && at < best_index)) {
      best_value = lane_value[l];
      best_index = at;
    }
  }
}

// With `logits`, p holds log-weights: the weights are exp(p - max p), computed in passing, and
// a log-weight below `cut` weighs nothing (as if it were -inf; -inf cuts nothing).
int64_t race_row(const float* p, int64_t vocab, uint64_t key, bool logits, float cut) {
  const float shift = logits ? row_max(p, vocab) : 0.f;
  if (logits && shift < cut)  // every logit cut: as a row all -inf
    return 0;
  if (logits && !std::isfinite(shift))  // a +inf logit is certain; a row all -inf gives 0
    return std::find(p, p + vocab, shift) - p;
  const fVec shift_v(shift), cut_v(cut);
  const bool cuts = cut > -std::numeric_limits<float>::infinity();
  const iVec low(static_cast<int32_t>(static_cast<uint32_t>(key)));
  const iVec high(static_cast<int32_t>(static_cast<uint32_t>(key >> 32)));
  // lanes keep their first maximum (spans of kSpan: indices travel as floats)
  float best_value = -1.f;
  int64_t best_index = 0;
  int64_t j = 0;
  for (int64_t span = 0; span + kVec <= vocab; span += kSpan) {
    const int64_t span_end = std::min(vocab, span + kSpan);
    fVec best(-1.f), best_at(0.f), at_lane = fVec::arange(0.f, 1.f);
    for (j = span; j + kVec <= span_end; j += kVec, at_lane = at_lane + fVec(float(kVec))) {
      fVec w = fVec::loadu(p + j);
      if (logits) {
        const fVec below = w < cut_v;
        w = (w - shift_v).exp_u20();
        if (cuts) w = fVec::blendv(w, fVec(0.f), below);
      }
      const fVec score = w / exponential_noise(low, high, static_cast<int32_t>(j));
      const fVec better = score > best;
      best = fVec::blendv(best, score, better);
      best_at = fVec::blendv(best_at, at_lane, better);
    }
    fold_lanes(best, best_at, span, best_value, best_index);
  }
  for (; j < vocab; ++j) {  // the tail, after every whole vector
    const float w = !logits ? p[j] : p[j] < cut ? 0.f : std::exp(p[j] - shift);
    const float score = w / exponential_noise(key, static_cast<uint32_t>(j));
    if (score > best_value) {
      best_value = score;
      best_index = j;
    }
  }
  return best_index;
}

// The first index of the largest of x[0:n] (n > 0), as torch.argmax: ties go to the lowest
// index, and a NaN counts as the largest (its first one wins).
int64_t argmax_row(const float* x, int64_t n) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  float best_value = kLowest;
  int64_t best_index = 0;
  fVec nan_seen(0.f);
  int64_t j = 0;
  for (int64_t span = 0; span + kVec <= n; span += kSpan) {
    const int64_t span_end = std::min(n, span + kSpan);
    fVec best(kLowest), best_at = fVec::arange(0.f, 1.f), at_lane = best_at;
    for (j = span; j + kVec <= span_end; j += kVec, at_lane = at_lane + fVec(float(kVec))) {
      const fVec v = fVec::loadu(x + j);
      const fVec better = v > best;
      best = fVec::blendv(best, v, better);
      best_at = fVec::blendv(best_at, at_lane, better);
      nan_seen = nan_seen | v.isnan();
    }
    fold_lanes(best, best_at, span, best_value, best_index);
  }
  bool nan = nan_seen.zero_mask() != (1 << kVec) - 1;
  for (; j < n && !nan; ++j) {  // the tail, after every whole vector
    nan = std::isnan(x[j]);
    if (x[j] > best_value) {
      best_value = x[j];
      best_index = j;
    }
  }
  if (nan)
    return std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x;
  return best_index;
}

// out[0:n] = x[0:n] / d, each quotient rounded once, as torch's division rounds it
void divide_row(const float* x, int64_t n, float d, float* out) {
  const fVec dv(d);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) (fVec::loadu(x + j) / dv).store(out + j);
  for (; j < n; ++j) out[j] = x[j] / d;
}

}  // namespace

PDSERVE_ISA_END

namespace PDSERVE_OPS {

// probs: [rows, vocab] float32 (rows need not sum to 1), or with `logits` log-weights;
// keys: [rows] int64; cut (with `logits` only): [rows] float32, each row's logits below it
// weigh nothing; out: [rows] int64
void exponential_race(const at::Tensor& probs, const at::Tensor& keys, bool logits,
                      const std::optional<at::Tensor>& cut, at::Tensor out) {
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
  TORCH_CHECK(!cut.has_value() ||
                  (logits && cut->scalar_type() == at::kFloat && cut->dim() == 1 &&
                   cut->is_contiguous() && cut->size(0) == probs.size(0)),
              "cut: float32 [rows], with logits only");
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const float* c = cut.has_value() ? cut->data_ptr<float>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t vocab = probs.size(1), stride = probs.stride(0);
  pdserve_pool::parallel_for(0, probs.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = race_row(p + r * stride, vocab, static_cast<uint64_t>(k[r]), logits,
                      c ? c[r] : -std::numeric_limits<float>::infinity());
  });
}

// x: [rows, n] float32 with contiguous rows; d: [rows] float32; out: x's shape, contiguous rows:
// out = x / d[:, None] (a sampler's temperatures, on the kernels' threads)
void divide_rows(const at::Tensor& x, const at::Tensor& d, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x: a float32 [rows, n] CPU tensor with contiguous rows");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 1 && d.is_contiguous() &&
                  d.size(0) == x.size(0),
              "d: float32 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && out.stride(1) == 1,
              "out: float32, x's shape, contiguous rows");
  const float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = x.size(1), xs = x.stride(0), os = out.stride(0);
  pdserve_pool::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) divide_row(xp + r * xs, n, dp[r], o + r * os);
  });
}

// x: [rows, n] float32 with contiguous rows, n > 0; out: [rows] int64, torch.argmax(x, -1)
void argmax_rows(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1 && x.size(1) > 0,
              "x: a float32 [rows, n > 0] CPU tensor with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                  out.size(0) == x.size(0),
              "out: int64 [rows]");
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  pdserve_pool::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * stride, n);
  });
}

}  // namespace PDSERVE_OPS
