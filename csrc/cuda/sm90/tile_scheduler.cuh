// The one interface through which the Hopper kernels' roles find their work.
// A schedule says which work items a CTA does, in order:
//   using Item = ...;                          // what locates an item
//   static constexpr bool kOneItemPerCta;      // the grid has a CTA per item
//   ScheduleStep tile(int64_t k, Item& out) const;  // this CTA's k-th item
// and every role of a CTA (producer, consumers, writers) walks the same items
// with for_each_work_tile. The forward's schedules are persistent
// (fwd_scheduler.cuh); the backward's give each CTA one block (bwd_scheduler.cuh).
#pragma once

#include <cstdint>

namespace flashjax::cuda {

enum class ScheduleStep { kTile, kSkip, kEnd };

// Calls visit(item) for each of this CTA's items, in order. (An
// initial_work() / next_work(work) pair, one call before the loop and one per
// iteration, compiled the forward schedule's 64-bit divisions twice per role:
// +120 to +460 instructions and more spills at d128; one loop keeps one copy.
// With one item per CTA there is no loop.)
template <class Schedule, class Visit>
__device__ __forceinline__ void for_each_work_tile(const Schedule& schedule, Visit&& visit) {
  typename Schedule::Item item;
  if constexpr (Schedule::kOneItemPerCta) {
    if (schedule.tile(0, item) == ScheduleStep::kTile) visit(item);
  } else {
    for (int64_t k = 0;; ++k) {
      const ScheduleStep step = schedule.tile(k, item);
      if (step == ScheduleStep::kEnd) break;
      if (step == ScheduleStep::kSkip) continue;
      visit(item);
    }
  }
}

}  // namespace flashjax::cuda
