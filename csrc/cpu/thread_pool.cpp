#include "thread_pool.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flashreinforce {
namespace cpu {
namespace {

// One parallel_for call. Helpers that wake up late find `next` exhausted and leave at once; the
// caller waits for completed tasks, never for helpers to check in (a helper the OS has not
// scheduled yet must not delay a call that the caller could finish alone).
struct Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
  std::exception_ptr error;

  void work() {
    for (;;) {
      const int64_t task = next.fetch_add(1);
      if (task >= num_tasks) return;
      int64_t completed = 1;
      try {
        (*fn)(task);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!error) error = std::current_exception();
        }
        // Abandon the tasks nobody claimed yet and count them as done.
        const int64_t rest = next.exchange(num_tasks);
        if (rest < num_tasks) completed += num_tasks - rest;
      }
      if (done.fetch_add(completed) + completed == num_tasks) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

class Pool {
 public:
  void run(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mutex_);  // one job at a time
    const int helpers = static_cast<int>(std::min<int64_t>(num_threads, num_tasks)) - 1;
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->num_tasks = num_tasks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(threads_.size()) < helpers) {
        const int id = static_cast<int>(threads_.size());
        threads_.emplace_back([this, id] { loop(id); });
      }
      current_ = job;
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->work();
    {
      std::unique_lock<std::mutex> lock(job->mutex);
      job->finished.wait(lock, [&] { return job->done.load() == num_tasks; });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (current_ == job) current_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      // A loss call runs several parallel_for in a row (counting, main pass, zeroing), and a
      // training step calls the loss right after its previous call: after a job, watch for the
      // next one for a short while before sleeping, so that it does not pay a wake-up (tens of
      // microseconds on virtual machines) each time. Bounded, so an idle pool costs nothing.
      const auto spin_until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < spin_until) {
        cpu_relax();
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        if (id >= wanted_ || !current_) continue;
        job = current_;
      }
      job->work();
    }
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  static constexpr std::chrono::microseconds kSpin{100};

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  std::shared_ptr<Job> current_;
  int wanted_ = 0;
  std::atomic<uint64_t> generation_{0};
};

// The pool's threads do not survive fork(): a child process gets a fresh pool (the parent's
// object is deliberately leaked in the child, where its threads do not exist). Pools are never
// destroyed: their threads block on a condition variable until the process exits.
Pool* pool_for_this_process() {
  static std::mutex mutex;
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  const pid_t pid = getpid();
  if (pool == nullptr || owner != pid) {
    pool = new Pool();
    owner = pid;
  }
  return pool;
}

// The host process's OpenMP runtime, found by name among the symbols already loaded (PyTorch's CPU
// builds load theirs, libgomp, with global visibility): GOMP_parallel is the entry point GCC
// compiles `#pragma omp parallel` to, which LLVM's and Intel's runtimes export as well. Looked up
// once; nullptr when no runtime is loaded (a C++ test binary, a process without PyTorch).
using GompParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);

GompParallelFn host_openmp_parallel() {
  static const GompParallelFn fn = reinterpret_cast<GompParallelFn>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
  return fn;
}

}  // namespace

void parallel_for_host_threads(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  const GompParallelFn gomp = host_openmp_parallel();
  if (gomp == nullptr || num_threads <= 1 || num_tasks <= 1) {
    parallel_for(num_threads, num_tasks, fn);
    return;
  }
  // The pool's job, claimed by every thread of the OpenMP team instead of the pool's helpers; an
  // exception stays inside the team (it must not cross the runtime) and is rethrown after it.
  Job job;
  job.fn = &fn;
  job.num_tasks = num_tasks;
  const int64_t threads = std::min<int64_t>(num_threads, num_tasks);
  gomp([](void* data) { static_cast<Job*>(data)->work(); }, &job, static_cast<unsigned>(threads), 0);
  if (job.error) std::rethrow_exception(job.error);
}

void parallel_for(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  if (num_threads <= 1 || num_tasks == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  pool_for_this_process()->run(num_threads, num_tasks, fn);
}

}  // namespace cpu
}  // namespace flashreinforce
