// A small persistent thread pool owned by the core (no OpenMP: the host process, e.g. PyTorch,
// may bring its own OpenMP runtime, and two runtimes in one process fight over the cores).
#pragma once

#include <cstdint>
#include <functional>

namespace flashreinforce {
namespace cpu {

// Runs fn(task) for every task in [0, num_tasks), on the calling thread plus up to
// num_threads - 1 pool threads, with dynamic scheduling. Returns when all tasks are done.
// Which thread runs a task is not deterministic; callers make results independent of it by
// writing each task's results to its own slots. Calls from several host threads are serialized.
void parallel_for(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn);

}  // namespace cpu
}  // namespace flashreinforce
