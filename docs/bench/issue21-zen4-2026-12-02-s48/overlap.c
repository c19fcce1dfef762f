#include <stdint.h>
#include <string.h>
// read_blocks with `work` dependent multiply-adds on each line's data after loading it
uint64_t read_work(const char* base, const int64_t* offsets, int64_t n, int64_t block_bytes,
                   int64_t value_offset, int64_t ahead, int64_t work) {
  uint64_t acc[8] = {0}, x = 1;
  int64_t lines = block_bytes / 64, total = n * lines, step = ahead / 64;
  for (int64_t i = 0; i < total; ++i) {
    const char* k = base + offsets[i / lines] + (i % lines) * 64;
    if (i + step < total) {
      const char* p = base + offsets[(i + step) / lines] + ((i + step) % lines) * 64;
      __builtin_prefetch(p, 0, 2);
      __builtin_prefetch(p + value_offset, 0, 2);
    }
    uint64_t w[8], y[8];
    memcpy(w, k, 64);
    memcpy(y, k + value_offset, 64);
    for (int j = 0; j < 8; ++j) acc[j] += w[j] ^ y[j];
    x ^= w[0];
    for (int64_t r = 0; r < work; ++r) x = x * 0x9E3779B97F4A7C15ull + 1;
  }
  uint64_t s = x;
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}
// the same work on one resident block, for the compute time alone

#include <immintrin.h>
// the same read with `work` rounds of 8 independent 512-bit FMA chains on each line's data (wide
// work that fills the core's queues, as the attention kernels' products do)
uint64_t read_vwork(const char* base, const int64_t* offsets, int64_t n, int64_t block_bytes,
                    int64_t value_offset, int64_t ahead, int64_t work) {
  __m512 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
  int64_t lines = block_bytes / 64, total = n * lines, step = ahead / 64;
  for (int64_t i = 0; i < total; ++i) {
    const char* k = base + offsets[i / lines] + (i % lines) * 64;
    if (i + step < total) {
      const char* p = base + offsets[(i + step) / lines] + ((i + step) % lines) * 64;
      __builtin_prefetch(p, 0, 2);
      __builtin_prefetch(p + value_offset, 0, 2);
    }
    __m512 x = _mm512_loadu_ps(k), y = _mm512_loadu_ps(k + value_offset);
    for (int64_t r = 0; r < work; ++r)
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(x, y, acc[j]);
  }
  __m512 s = acc[0];
  for (int j = 1; j < 8; ++j) s = _mm512_add_ps(s, acc[j]);
  float f[16];
  _mm512_storeu_ps(f, s);
  uint64_t out = 0;
  for (int j = 0; j < 16; ++j) out += (uint64_t)f[j];
  return out;
}
