#include "thread_pool.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace flashreinforce {
namespace cpu {
namespace {

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mutex_);  // one job at a time
    const int helpers = static_cast<int>(std::min<int64_t>(num_threads, num_tasks)) - 1;
    ensure_threads(helpers);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_.store(0);
      active_helpers_ = helpers;
      finished_helpers_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return finished_helpers_ == active_helpers_; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void ensure_threads(int count) {
    while (static_cast<int>(threads_.size()) < count) {
      const int id = static_cast<int>(threads_.size());
      threads_.emplace_back([this, id] { loop(id); });
    }
  }

  void work() {
    for (;;) {
      const int64_t task = next_.fetch_add(1);
      if (task >= num_tasks_) return;
      try {
        (*fn_)(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(num_tasks_);
      }
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= active_helpers_) continue;  // not needed for this job
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++finished_helpers_;
      }
      done_.notify_all();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int active_helpers_ = 0;
  int finished_helpers_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The pool's threads do not survive fork(): a child process gets a fresh pool (the parent's
// object is deliberately leaked in the child, since its threads do not exist there).
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

}  // namespace

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
