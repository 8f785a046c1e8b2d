// Where a kernel's parallel loops run: `each(n, body)` calls body(i) for every i in [0, n) (once each, in any
// order, on any thread), either as a worksharing loop of the enclosing OpenMP parallel region (the default: the
// team's threads split [0, n) in static ranges and meet at a barrier) or, on a thread that asked for it with
// `claim(width)` and whose region runs on that thread alone, on this library's claim pool: `width` - 1 worker
// threads and the calling thread take blocks of [0, n) from one counter until none is left, and the caller
// returns once every block is done. A thread the scheduler took off its core holds a claim job up only while it
// holds a block, never at a barrier it has not reached: beside busy processes a team of OpenMP threads waits for
// its descheduled threads at every region, the pool's caller finishes their share (benchmarks/team_wait.cpp).
// The bodies compute the same values whichever thread runs them (the kernels' outputs do not depend on how the
// work is split), so the two give the same bits.
//
// The pool serves one caller at a time (a second caller, on another thread, runs its loop alone); its workers
// spin `kSpin` pauses after a job, then sleep on a futex (the pool is for a contended CPU, where a worker that
// spins longer takes the core from the caller: beside 1 busy process on 2 cores 4000 pauses cost the pool 10-25%
// against one thread, 200 nothing). It is made on first use and never destroyed (its threads end with the
// process). Linux only, as the kernels.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>

namespace {
namespace team {

constexpr int kSpin = 200;           // pauses an idle worker spins before it sleeps (a few microseconds)
constexpr int kYieldAfter = 1000;    // pauses the caller spins on unfinished blocks before it yields its core
constexpr int64_t kMaxItems = 1 << 24;  // a loop of this many items or more runs on OpenMP (24 bits of n and next)

thread_local int tl_width = 0;  // this thread's claim width (0 or 1: OpenMP)

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool;  // never destroyed: its detached workers may still sleep at exit
    return *pool;
  }

  // At least `width` - 1 workers (started on first need).
  void grow(int width) {
    std::lock_guard<std::mutex> hold(start_);
    for (; workers_ < width - 1; ++workers_) std::thread([this] { work(); }).detach();
  }

  // body(ctx, begin, end) over [0, n) on this thread and the workers; false (nothing run) when another caller
  // holds the pool.
  bool run(int64_t n, int64_t grain, void (*body)(const void*, int64_t, int64_t), const void* ctx) {
    std::unique_lock<std::mutex> hold(busy_, std::try_to_lock);
    if (!hold.owns_lock()) return false;
    body_ = body;
    ctx_ = ctx;
    grain_.store(grain, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 48) + 1;
    ticket_.store(gen << 48 | static_cast<uint64_t>(n) << 24, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<int*>(&wake_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    claim(gen & 0xffff);
    for (int s = 0; done_.load(std::memory_order_acquire) < n;)
      if (++s < kYieldAfter) _mm_pause(); else sched_yield();
    return true;
  }

 private:
  // Blocks of job `gen` until none is left. The ticket holds (generation, n, next); a block is ours only if the
  // ticket still names this job when we take it, so a worker that comes late never runs another job's body.
  void claim(uint64_t gen) {
    for (uint64_t t = ticket_.load(std::memory_order_acquire);;) {
      const int64_t n = static_cast<int64_t>(t >> 24 & 0xffffff), next = static_cast<int64_t>(t & 0xffffff);
      if ((t >> 48) != gen || next >= n) return;
      const int64_t grain = grain_.load(std::memory_order_relaxed);  // (another job's if the ticket moved on:
      const int64_t end = next + grain < n ? next + grain : n;  // then the exchange fails)
      if (!ticket_.compare_exchange_weak(t, (t & ~uint64_t{0xffffff}) | static_cast<uint64_t>(end),
                                         std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      body_(ctx_, next, end);
      done_.fetch_add(end - next, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      for (int s = 0; wake_.load(std::memory_order_acquire) == seen;) {
        if (++s < kSpin) {
          _mm_pause();
          continue;
        }
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        syscall(SYS_futex, reinterpret_cast<int*>(&wake_), FUTEX_WAIT_PRIVATE, static_cast<int>(seen), nullptr,
                nullptr, 0);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        s = 0;
      }
      seen = wake_.load(std::memory_order_acquire);
      claim(ticket_.load(std::memory_order_acquire) >> 48);
    }
  }

  std::mutex busy_, start_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  void (*body_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  std::atomic<int64_t> grain_{1};
  int workers_ = 0;
};

// The calling thread's loops run on the claim pool with `width` threads from now on (width <= 1: OpenMP's).
inline void claim(int width) {
  tl_width = width > 1 ? width : 0;
  if (tl_width) Pool::get().grow(tl_width);
}

// The threads a loop of this thread's next region is split over (for sizing work: the bits do not depend on it).
inline int threads() { return tl_width > 1 ? tl_width : omp_get_max_threads(); }

// Whether `each` called here may run its body on the claim pool's threads (whose scratch is their own).
inline bool pooled() { return tl_width > 1 && omp_get_num_threads() == 1; }

// body(i) for i in [0, n): see the top. Called by every thread of an enclosing parallel region (or outside one).
template <typename Body>
inline void each(int64_t n, const Body& body) {
  if (n > 1 && n < kMaxItems && pooled()) {
    const int64_t grain = n / (4 * tl_width) > 1 ? n / (4 * tl_width) : 1;  // ~4 blocks a thread
    auto run = [](const void* ctx, int64_t b, int64_t e) {
      const Body& f = *static_cast<const Body*>(ctx);
      for (int64_t i = b; i < e; ++i) f(i);
    };
    if (Pool::get().run(n, grain, run, &body)) return;
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp for schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace team
}  // namespace
