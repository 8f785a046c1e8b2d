// How a team of two threads fares beside busy processes when it joins at a barrier (an OpenMP `parallel for`,
// as goose's kernels run) against a team whose threads claim chunks of a job and whose caller finishes the
// unclaimed ones without waiting for a thread that is not running (a "claim pool"), and against one thread.
// A job is N chunks of W iterations of a dependent multiply-add chain (no memory traffic); jobs run back to
// back for S seconds per configuration, beside 0, 1 and 2 busy processes (forked busy loops) on the machine.
//
//     g++ -O2 -std=c++20 -fopenmp benchmarks/team_wait.cpp -o /tmp/team_wait && /tmp/team_wait [S]
//
// Prints a markdown table: jobs/s of one thread, of the OpenMP team of 2 and of the claim pool of 2, and each
// team's speed against one thread's beside the same load. Not part of `make test`.
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

double sink[64];

void work(int64_t iters, int slot) {
  double x = slot + 1.0;
  for (int64_t i = 0; i < iters; ++i) x = x * 1.0000001 + 1e-9;
  sink[slot * 8 % 64] += x;
}

// One worker thread beside the caller. A job: `next` hands out chunk indices, `done` counts finished chunks;
// the caller claims chunks too and returns once all are done, so a worker that is not running holds the job up
// only while it holds a claimed chunk. An idle worker spins `spin` pauses, then sleeps on the job counter.
struct ClaimPool {
  std::atomic<uint64_t> gen{0};
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0, iters = 0;
  std::atomic<bool> stop{false};
  std::thread worker;
  int spin;

  explicit ClaimPool(int spin_) : spin(spin_) { worker = std::thread([this] { loop(); }); }
  ~ClaimPool() {
    stop = true;
    gen.fetch_add(1);
    gen.notify_all();
    worker.join();
  }
  void claim(int slot) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_acq_rel)) < n;) {
      work(iters, slot);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  void loop() {
    for (uint64_t seen = 0;;) {
      uint64_t g;
      for (int s = 0; (g = gen.load(std::memory_order_acquire)) == seen;)
        if (++s < spin) _mm_pause(); else gen.wait(seen);
      seen = g;
      if (stop) return;
      claim(1);
    }
  }
  void run(int64_t n_, int64_t iters_) {
    n = n_;
    iters = iters_;
    next.store(0);
    done.store(0);
    gen.fetch_add(1, std::memory_order_acq_rel);
    gen.notify_all();
    claim(0);
    for (int s = 0; done.load(std::memory_order_acquire) < n;)
      if (++s < 1000) _mm_pause(); else sched_yield();
  }
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <typename F>
double rate(double secs, F f) {
  const double t0 = now();
  int64_t jobs = 0;
  for (; now() - t0 < secs; ++jobs) f();
  return jobs / (now() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  const double secs = argc > 1 ? atof(argv[1]) : 3.0;
  const int64_t shapes[][2] = {{16, 500}, {16, 5000}, {64, 500}, {64, 5000}};
  printf("| busy processes | chunks x iterations | one thread jobs/s | OpenMP team of 2 | claim pool of 2 |\n");
  printf("|---|---|---|---|---|\n");
  ClaimPool pool(200);  // (team.h's kSpin)
  for (int busy = 0; busy <= 2; ++busy) {
    std::vector<pid_t> pids;
    for (int b = 0; b < busy; ++b) {
      const pid_t pid = fork();
      if (pid == 0)
        for (;;) asm volatile("");  // a busy process
      pids.push_back(pid);
    }
    usleep(300000);
    for (const auto& s : shapes) {
      const int64_t n = s[0], iters = s[1];
      const double one = rate(secs, [&] { for (int64_t i = 0; i < n; ++i) work(iters, 0); });
      const double team = rate(secs, [&] {
#pragma omp parallel for schedule(static) num_threads(2)
        for (int64_t i = 0; i < n; ++i) work(iters, omp_get_thread_num());
      });
      const double claim = rate(secs, [&] { pool.run(n, iters); });
      printf("| %d | %ld x %ld | %.0f | %.0f (%.2fx) | %.0f (%.2fx) |\n", busy, static_cast<long>(n),
             static_cast<long>(iters), one, team, team / one, claim, claim / one);
      fflush(stdout);
    }
    for (pid_t pid : pids) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
}
