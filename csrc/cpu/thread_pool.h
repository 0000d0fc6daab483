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

// The same contract, run on the threads of the host process's OpenMP runtime when one is loaded
// (PyTorch's CPU builds bring one), else by parallel_for. For short calls between the host's own
// parallel operations: after each of them its OpenMP workers keep spinning for a while, and a
// second set of threads (this pool's) would then share the cores with spinning threads (a decode
// step's attention between two matrix products ran about 1.4x slower on this pool).
void parallel_for_host_threads(int num_threads, int64_t num_tasks, const std::function<void(int64_t)>& fn);

}  // namespace cpu
}  // namespace flashreinforce
