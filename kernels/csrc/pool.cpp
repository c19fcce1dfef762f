// The kernels' thread pool (pool.h), and the ops that turn it on and read it.
#include "pool.h"

#include <pthread.h>

#include <chrono>
#include <vector>

#include "ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() ((void)0)
#endif

namespace pdserve_pool {
namespace {

// How long a helper spins for the next region before it sleeps: a decode step's regions come
// tens to hundreds of microseconds apart, steps a few milliseconds apart
constexpr auto kSpin = std::chrono::microseconds(1000);

thread_local bool in_region = false;  // a helper always; the caller while its region runs

Pool* instance = nullptr;

void fresh_after_fork() {
  instance = nullptr;  // the child has none of the parent's helpers: a new pool, unused state
}

}  // namespace

Pool& Pool::get() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, fresh_after_fork); });
  if (instance == nullptr) instance = new Pool();  // never destroyed: detached helpers use it
  return *instance;
}

void Pool::run(int64_t n, int threads, Item fn, const void* ctx) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> region(region_, std::defer_lock);
  if (threads <= 1 || n == 1 || in_region || !region.try_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  while (helpers_ < threads - 1) {
    std::thread([this, k = helpers_] { helper(k); }).detach();
    ++helpers_;
  }
  width_.store(threads - 1, std::memory_order_relaxed);
  fn_ = fn;
  ctx_ = ctx;
  n_.store(n, std::memory_order_relaxed);
  error_ = nullptr;
  done_.store(0, std::memory_order_relaxed);
  const uint64_t gen = ++gen_;
  ticket_.store(gen << 32, std::memory_order_release);
  if (sleepers_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(sleep_);
    wake_.notify_all();
  }
  in_region = true;
  work(gen);
  // items other threads claimed and still run
  while (done_.load(std::memory_order_acquire) < n) PDSERVE_PAUSE();
  in_region = false;
  if (error_) std::rethrow_exception(error_);
}

void Pool::work(uint64_t gen) {
  while (true) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    const int64_t i = static_cast<int64_t>(t & 0xffffffffu);
    // a region that ended (its generation passed) or has no item left
    if ((t >> 32) != gen || i >= n_.load(std::memory_order_relaxed)) return;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
    try {
      fn_(ctx_, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Pool::helper(int k) {
  in_region = true;  // a loop inside an item runs on this thread
  uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
  bool spin = true;  // after a region it worked in; one that left it out sleeps at once
  while (true) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t gen;
    int spins = 0;
    while ((gen = ticket_.load(std::memory_order_acquire) >> 32) == seen) {
      PDSERVE_PAUSE();
      if (++spins % 64 == 0 && (!spin || std::chrono::steady_clock::now() - start > kSpin)) {
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return ticket_.load(std::memory_order_acquire) >> 32 != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
    seen = gen;
    // region `gen` was written before its ticket; if it has ended and another begun, work()
    // finds the generation passed and claims nothing. A region on fewer threads than there are
    // helpers (the worker's share of the cores shrank) leaves the later helpers out: the cores
    // it gave back are another's.
    spin = k < width_.load(std::memory_order_relaxed);
    if (spin) work(gen);
  }
}

}  // namespace pdserve_pool

namespace PDSERVE_OPS {

void set_pool_threads(int64_t n) { pdserve_pool::Pool::get().set_threads(static_cast<int>(n)); }

int64_t pool_threads() { return pdserve_pool::Pool::get().threads(); }

}  // namespace PDSERVE_OPS
