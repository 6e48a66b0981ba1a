#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flashjax::cpu {
namespace {

// Shared state of one parallel_for call; helpers and the caller pull indices.
struct Job {
  int64_t n;
  const std::function<void(int64_t)>* fn;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void work() {
    int64_t completed = 0;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*fn)(i);
      ++completed;
    }
    if (completed > 0 && done.fetch_add(completed) + completed == n) {
      std::lock_guard<std::mutex> lock(mu);
      finished.notify_all();
    }
  }
};

class Pool {
 public:
  explicit Pool(int workers) {
    for (int t = 0; t < workers; ++t) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int workers() const { return static_cast<int>(threads_.size()); }

  void submit(std::shared_ptr<Job> job, int copies) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int c = 0; c < copies; ++c) queue_.push_back(job);
    }
    wake_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job->work();
    }
  }

  std::vector<std::thread> threads_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
};

int configured_threads() {
  if (const char* env = std::getenv("FLASHJAX_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  // Leaked on purpose: joining threads during static destruction at process
  // exit can deadlock with the runtime's own teardown.
  static Pool* p = new Pool(configured_threads() - 1);
  return *p;
}

}  // namespace

int num_threads() { return pool().workers() + 1; }

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int helpers = static_cast<int>(std::min<int64_t>(pool().workers(), n - 1));
  if (helpers == 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->n = n;
  job->fn = &fn;
  pool().submit(job, helpers);
  job->work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->finished.wait(lock, [&] { return job->done.load() == n; });
}

}  // namespace flashjax::cpu
