// The kernels' own thread pool, where a worker turns it on (set_pool_threads): on a CPU where
// these kernels compute nearly all of a step (float32 on AVX2: the panel linears, attention,
// the element-wise ops and sampling), a step's parallel loops run on it instead of OpenMP.
//
// Why not OpenMP there: a team's region ends only when every thread of the team has checked in,
// each having run its fixed share. The gateway, the scheduler and a load client share the
// server's cores; when the OS gives one of them a core for a few milliseconds, the team thread
// it took holds the region back that long, while its partner spins. A decode step of 60
// sequences took 74-84 ms beside bursts taking a third of a core against 55-57 ms alone (2 Zen 3
// cores; on the pool 68-78 and 53-55).
// Here the threads claim chunks of the loop one at a time (about 8 a thread), and the caller
// returns once every chunk is done: a helper that the OS preempted while it waited for work
// holds nothing back, one preempted mid-chunk that chunk only (docs/performance.md).
//
// Outside a region the helpers spin for 1 ms (kSpin, pool.cpp), then sleep until the next one.
// Where the pool is off (0 threads, the default), parallel_for is at::parallel_for, OpenMP's.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace pdserve_pool {

class Pool {
 public:
  using Item = void (*)(const void*, int64_t);

  static Pool& get();

  // 0: off (OpenMP runs the loops); n >= 1: the loops run on n threads, the caller among them
  void set_threads(int n) { threads_.store(std::max(0, n), std::memory_order_relaxed); }
  int threads() const { return threads_.load(std::memory_order_relaxed); }

  // fn(ctx, i) for each i in [0, n < 2^32) on up to `threads` threads, the caller among them
  // (and no more: helpers made for a larger count sit the region out);
  // returns when all are done, rethrowing the first exception an item raised. A call made while
  // another thread's region runs, or from inside a region, runs its items on the calling thread.
  void run(int64_t n, int threads, Item fn, const void* ctx);

 private:
  Pool() = default;
  void work(uint64_t gen);
  void helper(int k);  // the k-th helper made (0 first)

  std::atomic<int> threads_{0};
  std::mutex region_;  // one region at a time
  int helpers_ = 0;
  std::atomic<uint64_t> ticket_{0};  // the region's generation << 32 | its next item
  std::atomic<int64_t> done_{0};     // items of the current region finished
  // the current region, written before its ticket is released; a helper reads fn_ and ctx_ only
  // once it holds an item (the region cannot end before that item), n_ before (atomic)
  Item fn_ = nullptr;
  const void* ctx_ = nullptr;
  std::atomic<int64_t> n_{0};
  std::atomic<int> width_{0};  // the helpers the region may use: those made first
  uint64_t gen_ = 0;
  std::mutex error_lock_;
  std::exception_ptr error_;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

// The threads a loop may use: the pool's where it is on, else OpenMP's.
inline int num_threads() {
  const int pool = Pool::get().threads();
  return pool > 0 ? pool : at::get_num_threads();
}

// How many parts to cut a loop of `threads` threads into: one a thread for OpenMP's fixed
// shares, kChunks a thread for the pool's claims.
inline int64_t num_parts(int threads) {
  constexpr int64_t kChunks = 8;
  return Pool::get().threads() > 0 && threads > 1 ? threads * kChunks : threads;
}

// at::parallel_for's contract: f(begin, end) over sub-ranges of [begin, end) of at least
// `grain` items (the whole range where it is shorter), on the pool where it is on.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool& pool = Pool::get();
  const int threads = pool.threads();
  if (threads == 0) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t chunks = std::min(range / std::max<int64_t>(grain, 1), num_parts(threads));
  if (threads == 1 || chunks <= 1) {
    f(begin, end);
    return;
  }
  struct Ctx {
    const F* f;
    int64_t begin, range, chunks;
  } ctx{&f, begin, range, chunks};
  pool.run(
      chunks, threads,
      [](const void* p, int64_t i) {
        const Ctx& c = *static_cast<const Ctx*>(p);
        (*c.f)(c.begin + i * c.range / c.chunks, c.begin + (i + 1) * c.range / c.chunks);
      },
      &ctx);
}

}  // namespace pdserve_pool
