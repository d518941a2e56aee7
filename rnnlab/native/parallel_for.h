// What the lab's fused recurrence kernels share: work over (batch row, head) items on XLA's intra-op thread pool.
// A header of rnnlab/native/, compiled into each kernel (rnnlab/native_build.py hashes it with the source).

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace rnnlab {

// Runs body(item) for item in [0, count) on the caller and on XLA's pool; returns when every item is done.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

inline void ParallelFor(xla::ffi::ThreadPool* pool, int64_t count, const std::function<void(int64_t)>& body) {
  int64_t helpers = pool ? std::min<int64_t>(pool->num_threads(), count) - 1 : 0;
  if (helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  // `body` lives on the caller's stack: a late task must not touch it once every item is done, so tasks reach it
  // only through an item they took (next < count), and the caller returns only after `done` reaches count.
  const std::function<void(int64_t)>* work = &body;
  auto run = [shared, work, count] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < count;) {
      (*work)(i);
      if (shared->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->finished.notify_all();
      }
    }
  };
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = run;  // Schedule takes its task by value
    pool->Schedule(std::move(task));
  }
  run();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done.load() == count; });
}

}  // namespace rnnlab
