// A small process-wide worker pool for the CPU path. parallel_for hands out
// indices from an atomic counter so that uneven work (causal tiles) balances;
// the calling thread works too, so concurrent callers never deadlock.
#pragma once

#include <cstdint>
#include <functional>

namespace flashjax::cpu {

// Number of threads parallel_for uses (workers + caller). Honours
// FLASHJAX_CPU_THREADS, else std::thread::hardware_concurrency().
int num_threads();

// Runs fn(i) for i in [0, n), in parallel, and returns when all are done.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace flashjax::cpu
