// CUDA path of the fused FlashREINFORCE loss.
//
// Token-parallel throughout: every kernel over tokens works on fixed tiles of kTile tokens
// (kThreads threads x kItems consecutive tokens each), whatever the trajectory lengths, so one
// 1M-token trajectory next to thousands of 10-token ones spreads over all SMs. Per-trajectory sums
// use the same body/head split as the CPU path: inside a tile a block-wide segmented scan (CUB)
// produces one partial per (tile, trajectory piece); the piece in which a trajectory starts is its
// "body", the piece of a trajectory that started in an earlier tile is that tile's "head"; a
// combine kernel adds body + heads in tile order (a warp per trajectory, fixed shuffle tree). The
// summation order therefore depends on the tile size only (a compile-time constant), never on the
// grid or the GPU: results are deterministic.
//
// The entropy filter's kept tokens are selected on the GPU by a per-trajectory radix select over
// the composite key (entropy, -position) with 8-bit digits: each pass histograms the candidates of
// the still-unresolved trajectories (shared-memory histogram for the tile's leading trajectory,
// global atomics otherwise), then a resolve kernel picks the digit; most trajectories resolve after
// the first entropy digits. The selection is written as 1 / 0 flags into the gradient buffer,
// which the main pass reads and overwrites (no temporary proportional to N).
//
// Errors go to an error key in the workspace (atomicMin over code << 56 | index, so the reported
// error is the same as on the CPU: smallest code, then smallest index) and are copied into the
// caller's error record by the last kernel. Nothing synchronizes with the host unless the caller
// asks for it, so the launch sequence can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "flashreinforce/core.h"
#include "flashreinforce/dtype_load.h"
#include "flashreinforce/token_math.h"
#include "flashreinforce/trajectory.h"

namespace flashreinforce {
namespace {

using math::BFloat16;
using math::Half;

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int64_t kTile = kThreads * kItems;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
constexpr unsigned long long kNoError = ~0ull;

#define FR_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    cudaError_t _e = (expr);                                                                   \
    if (_e != cudaSuccess) {                                                                   \
      throw std::runtime_error(std::string("flashreinforce CUDA error: ") + cudaGetErrorString(_e) + \
                               " at " #expr);                                                  \
    }                                                                                          \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Workspace layout.

struct Workspace {
  unsigned long long* error_key;  // [1]
  int64_t* cu;                    // [B+1]
  int64_t* counts;                // [B]
  int64_t* keep_count;            // [B]
  double* coef;                   // [B]
  uint8_t* keep;                  // [B]
  double* body;                   // [B * 2]   (kl, loss) or (count, -)
  double* head;                   // [tiles * 2]
  unsigned long long* overflow;   // [B] first active token whose ratio overflows, or ~0
  unsigned long long* grad_overflow;  // [B] first active token whose gradient overflows the dtype of log_probs, or ~0
  double* loss_terms;             // [B]
  // Filter state (only when q < 1).
  unsigned long long* prefix_e;   // [B] entropy-key digits fixed so far
  unsigned int* prefix_p;         // [B] position-key digits fixed so far
  int64_t* remaining;             // [B]
  uint8_t* active;                // [B] still selecting
  unsigned long long* thr_e;      // [B] threshold (entropy key, position key): kept iff >= (lexicographic)
  unsigned int* thr_p;            // [B]
  unsigned int* hist;             // [B * kBins]
  size_t bytes;
};

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

Workspace layout(int64_t b, int64_t tiles, bool filter, char* base) {
  Workspace w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = base ? base + off : nullptr;
    off += align_up(bytes);
    return p;
  };
  w.error_key = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long)));
  w.cu = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * (b + 1)));
  w.counts = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * b));
  w.keep_count = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * b));
  w.coef = reinterpret_cast<double*>(take(sizeof(double) * b));
  w.keep = reinterpret_cast<uint8_t*>(take(b));
  w.body = reinterpret_cast<double*>(take(sizeof(double) * 2 * b));
  w.head = reinterpret_cast<double*>(take(sizeof(double) * 2 * tiles));
  w.overflow = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * b));
  w.grad_overflow = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * b));
  w.loss_terms = reinterpret_cast<double*>(take(sizeof(double) * b));
  if (filter) {
    w.prefix_e = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * b));
    w.prefix_p = reinterpret_cast<unsigned int*>(take(sizeof(unsigned int) * b));
    w.remaining = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * b));
    w.active = reinterpret_cast<uint8_t*>(take(b));
    w.thr_e = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * b));
    w.thr_p = reinterpret_cast<unsigned int*>(take(sizeof(unsigned int) * b));
    w.hist = reinterpret_cast<unsigned int*>(take(sizeof(unsigned int) * kBins * b));
  }
  w.bytes = off;
  return w;
}

// ---------------------------------------------------------------------------------------------
// Small device helpers.

__device__ __forceinline__ void report(unsigned long long* error_key, ErrorCode code, int64_t index) {
  const unsigned long long key =
      (static_cast<unsigned long long>(code) << 56) | (static_cast<unsigned long long>(index) & ((1ull << 56) - 1));
  atomicMin(error_key, key);
}

// Offsets are unusable after a cu_seqlens error: every later kernel returns at once.
__device__ __forceinline__ bool offsets_invalid(const unsigned long long* error_key) {
  return (*error_key >> 56) == static_cast<unsigned long long>(ErrorCode::kBadCuSeqlens);
}

// Last i in [lo, hi] with cu[i] <= t (cu non-decreasing, cu[lo] <= t).
__device__ __forceinline__ int64_t find_segment(const int64_t* cu, int64_t lo, int64_t hi, int64_t t) {
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <class T> struct Raw { using type = T; };
template <> struct Raw<Half> { using type = uint16_t; };
template <> struct Raw<BFloat16> { using type = uint16_t; };

template <class T> __device__ __forceinline__ T from_raw(typename Raw<T>::type r) { return r; }
template <> __device__ __forceinline__ Half from_raw<Half>(uint16_t r) { return Half{r}; }
template <> __device__ __forceinline__ BFloat16 from_raw<BFloat16>(uint16_t r) { return BFloat16{r}; }

template <class T> __device__ __forceinline__ typename Raw<T>::type to_raw(T v) { return v; }
template <> __device__ __forceinline__ uint16_t to_raw<Half>(Half v) { return v.bits; }
template <> __device__ __forceinline__ uint16_t to_raw<BFloat16>(BFloat16 v) { return v.bits; }

// A thread's kItems consecutive values [src, src + kItems) through 16-byte (or, for 8-byte runs,
// 8-byte) vector loads when all of them are in range and the address is aligned, else one by one
// (`fill` past `valid`). All of a thread's loads are in flight at once, and no shared memory or
// block barrier is needed, whatever the dtype; values are bit-identical to scalar loads.
template <class R> __device__ __forceinline__ R raw_from_bits(uint64_t bits) {
  R v;
  memcpy(&v, &bits, sizeof(R));  // the low sizeof(R) bytes (little endian)
  return v;
}
template <class R> __device__ __forceinline__ uint64_t raw_bits(R v) {
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(R));
  return bits;
}

template <class R>
__device__ __forceinline__ bool vector_ok(const R* p, int valid) {
  constexpr int kBytes = static_cast<int>(sizeof(R)) * kItems;
  const uintptr_t align = kBytes % 16 == 0 ? 15 : 7;
  return valid >= kItems && (reinterpret_cast<uintptr_t>(p) & align) == 0;
}

template <class R>
__device__ __forceinline__ void load_items(const R* src, int valid, R fill, R (&out)[kItems]) {
  constexpr int kWords = static_cast<int>(sizeof(R)) * kItems / 4;  // 2, 4, 8 or 16
  static_assert(kWords == 2 || kWords % 4 == 0, "a thread's run must be 8 bytes or a multiple of 16");
  if (vector_ok(src, valid)) {
    uint32_t words[kWords];
    if constexpr (kWords % 4 == 0) {
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        words[4 * i] = v.x;
        words[4 * i + 1] = v.y;
        words[4 * i + 2] = v.z;
        words[4 * i + 3] = v.w;
      }
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      words[0] = v.x;
      words[1] = v.y;
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      uint64_t bits;
      if constexpr (sizeof(R) == 8) {
        bits = static_cast<uint64_t>(words[2 * k]) | (static_cast<uint64_t>(words[2 * k + 1]) << 32);
      } else {
        bits = words[k * sizeof(R) / 4] >> ((k * sizeof(R) % 4) * 8);
      }
      out[k] = raw_from_bits<R>(bits);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) out[k] = k < valid ? src[k] : fill;
}

// The store counterpart of load_items: [dst, dst + valid) receives in[0 .. valid).
template <class R>
__device__ __forceinline__ void store_items(R* dst, int valid, const R (&in)[kItems]) {
  constexpr int kWords = static_cast<int>(sizeof(R)) * kItems / 4;
  if (vector_ok(dst, valid)) {
    uint32_t words[kWords];
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = 0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const uint64_t bits = raw_bits(in[k]);
      if constexpr (sizeof(R) == 8) {
        words[2 * k] = static_cast<uint32_t>(bits);
        words[2 * k + 1] = static_cast<uint32_t>(bits >> 32);
      } else {
        words[k * sizeof(R) / 4] |= static_cast<uint32_t>(bits) << ((k * sizeof(R) % 4) * 8);
      }
    }
    if constexpr (kWords % 4 == 0) {
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]);
      }
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    if (k < valid) dst[k] = in[k];
  }
}

// How many of a thread's kItems tokens starting at `base` exist (0 past the end).
__device__ __forceinline__ int items_in_range(int64_t base, int64_t n) {
  return base >= n ? 0 : static_cast<int>(n - base < kItems ? n - base : kItems);
}

// Element of the block-wide segmented scan over threads: the sum of a thread's trailing run and a
// flag telling whether that run starts inside the thread (then sums from earlier threads stop).
template <int NV>
struct ScanElem {
  int flag;
  double v[NV];
};

template <int NV>
struct SegmentedSum {
  __device__ __forceinline__ ScanElem<NV> operator()(const ScanElem<NV>& a, const ScanElem<NV>& b) const {
    ScanElem<NV> r;
    r.flag = a.flag | b.flag;
#pragma unroll
    for (int k = 0; k < NV; ++k) r.v[k] = b.flag ? b.v[k] : a.v[k] + b.v[k];
    return r;
  }
};

// Per-tile segmented reduction. `contrib(k, t, seg, out)` fills the NV contributions of item k
// (token t of trajectory seg). Writes one partial per (tile, trajectory piece): body[seg * NV + k]
// for a piece where the trajectory starts in this tile, head[tile * NV + k] for the tile's leading
// piece of a trajectory that started earlier.
template <int NV, class Contrib>
__device__ __forceinline__ void tile_segmented_sums(const int64_t* cu, int64_t n, int64_t seg_lo, int64_t seg_hi,
                                                    double* body, double* head, Contrib contrib) {
  using Scan = cub::BlockScan<ScanElem<NV>, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ ScanElem<NV> scanned[kThreads];

  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t base = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
  const int64_t end = min(base + kItems, n);
  const bool has_items = base < n;

  int64_t first_seg = -1, last_seg = -1;
  double first_sum[NV], run_sum[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) first_sum[k] = run_sum[k] = 0.0;
  if (has_items) {
    int64_t seg = find_segment(cu, seg_lo, seg_hi, base);
    first_seg = seg;
    int64_t run_seg = seg;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t t = base + k;
      if (t < end) {
        while (cu[seg + 1] <= t) ++seg;
        if (seg != run_seg) {
          if (run_seg == first_seg) {
#pragma unroll
            for (int j = 0; j < NV; ++j) first_sum[j] = run_sum[j];
          } else {
            // A piece that starts and ends inside this thread.
#pragma unroll
            for (int j = 0; j < NV; ++j) body[run_seg * NV + j] = run_sum[j];
          }
#pragma unroll
          for (int j = 0; j < NV; ++j) run_sum[j] = 0.0;
          run_seg = seg;
        }
        double c[NV];
        contrib(k, t, seg, c);
#pragma unroll
        for (int j = 0; j < NV; ++j) run_sum[j] += c[j];
      }
    }
    last_seg = run_seg;
    if (last_seg == first_seg) {
#pragma unroll
      for (int j = 0; j < NV; ++j) first_sum[j] = run_sum[j];
    }
  }

  ScanElem<NV> elem;
  elem.flag = has_items ? (cu[last_seg] >= base ? 1 : 0) : 1;
#pragma unroll
  for (int j = 0; j < NV; ++j) elem.v[j] = has_items ? run_sum[j] : 0.0;
  ScanElem<NV> inclusive;
  Scan(scan_storage).InclusiveScan(elem, inclusive, SegmentedSum<NV>());
  scanned[threadIdx.x] = inclusive;
  __syncthreads();
  if (!has_items) return;

  auto write_piece = [&](int64_t seg, const double* v) {
    if (cu[seg] >= t0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) body[seg * NV + j] = v[j];
    } else {
#pragma unroll
      for (int j = 0; j < NV; ++j) head[static_cast<int64_t>(blockIdx.x) * NV + j] = v[j];
    }
  };
  if (first_seg != last_seg) {
    // The first run ends inside this thread: add what earlier threads hold of it.
    double v[NV];
    const bool carried = cu[first_seg] < base && threadIdx.x > 0;
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] = first_sum[j] + (carried ? scanned[threadIdx.x - 1].v[j] : 0.0);
    write_piece(first_seg, v);
  }
  // The trailing run ends here when its trajectory ends within this thread or the tile ends.
  if (cu[last_seg + 1] <= end || threadIdx.x == kThreads - 1 || end == n) {
    write_piece(last_seg, inclusive.v);
  }
}

// The range of trajectories a tile touches (computed once per block by two searches).
__device__ __forceinline__ void tile_segment_range(const int64_t* cu, int64_t batch, int64_t n, int64_t* lo,
                                                   int64_t* hi) {
  __shared__ int64_t range[2];
  if (threadIdx.x == 0) {
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
    const int64_t t1 = min(t0 + kTile, n) - 1;
    range[0] = find_segment(cu, 0, batch - 1, t0);
    range[1] = find_segment(cu, range[0], batch - 1, t1);
  }
  __syncthreads();
  *lo = range[0];
  *hi = range[1];
}

// ---------------------------------------------------------------------------------------------
// Kernels.

__global__ void prepare_offsets_kernel(const void* cu_src, int cu_is_int32, int64_t padded_row, int64_t batch,
                                       int64_t n, int64_t* cu, unsigned long long* error_key) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i > batch) return;
  auto at = [&](int64_t j) -> int64_t {
    if (cu_src == nullptr) return j * padded_row;
    return cu_is_int32 ? static_cast<const int32_t*>(cu_src)[j] : static_cast<const int64_t*>(cu_src)[j];
  };
  const int64_t v = at(i);
  cu[i] = v;
  if (i == 0 && v != 0) report(error_key, ErrorCode::kBadCuSeqlens, 0);
  if (i > 0 && v < at(i - 1)) report(error_key, ErrorCode::kBadCuSeqlens, i);
  if (i == batch && v != n) report(error_key, ErrorCode::kBadCuSeqlens, batch);
}

__global__ void count_kernel(const uint8_t* mask, const int64_t* cu, int64_t batch, int64_t n, double* body,
                             double* head, const unsigned long long* error_key) {
  if (offsets_invalid(error_key)) return;
  int64_t lo, hi;
  tile_segment_range(cu, batch, n, &lo, &hi);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
  uint8_t m[kItems];
  load_items<uint8_t>(mask + base, items_in_range(base, n), uint8_t(0), m);
  tile_segmented_sums<1>(cu, n, lo, hi, body, head,
                         [&](int k, int64_t, int64_t, double* c) { c[0] = m[k] ? 1.0 : 0.0; });
}

// Adds body + heads of every trajectory (warp per trajectory; fixed lane order and shuffle tree).
template <int NV>
__device__ __forceinline__ void combine_pieces(const int64_t* cu, const double* body, const double* head, int64_t i,
                                               double* total) {
  const int lane = threadIdx.x & 31;
  const int64_t a = cu[i], b = cu[i + 1];
  double acc[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) acc[j] = 0.0;
  if (b > a) {
    const int64_t first_tile = a / kTile + 1;  // tiles starting strictly inside [a, b)
    const int64_t last_tile = (b - 1) / kTile;
    for (int64_t tile = first_tile + lane; tile <= last_tile; tile += 32) {
#pragma unroll
      for (int j = 0; j < NV; ++j) acc[j] += head[tile * NV + j];
    }
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    for (int offset = 16; offset > 0; offset >>= 1) acc[j] += __shfl_down_sync(0xffffffffu, acc[j], offset);
    total[j] = body[i * NV + j] + acc[j];  // valid on lane 0
  }
}

__global__ void combine_counts_kernel(const int64_t* cu, int64_t batch, const double* body, const double* head,
                                      int64_t* counts, const unsigned long long* error_key) {
  if (offsets_invalid(error_key)) return;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (i >= batch) return;
  double total[1];
  combine_pieces<1>(cu, body, head, i, total);
  if ((threadIdx.x & 31) == 0) counts[i] = static_cast<int64_t>(total[0]);
}

__global__ void lengths_kernel(const int64_t* cu, int64_t batch, int64_t* counts, const unsigned long long* error_key) {
  if (offsets_invalid(error_key)) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < batch) counts[i] = cu[i + 1] - cu[i];
}

struct TrajParams {
  const void* rewards;
  DType rewards_dtype;
  const uint8_t* failures;  // null: filter off
  double q;
  bool has_baseline;
  double baseline;
  double num_trajectories;
  LossAgg agg;
  double loss_scale_factor;
  double num_policy_tokens;  // <= 0: sum of counts
};

template <class C>
__global__ void __launch_bounds__(1024) trajectory_kernel(TrajParams p, int64_t batch, Workspace w, C* advantages,
                                                          int64_t* policy_tokens) {
  if (offsets_invalid(w.error_key)) return;
  constexpr bool kComputeDouble = sizeof(C) == 8;
  using Reduce = cub::BlockReduce<double, 1024>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ double shared_sum[2];
  double reward_sum = 0.0, token_sum = 0.0;
  for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
    const double r = load_as_double(p.rewards, p.rewards_dtype, i);
    if (!finite_in_compute(r, kComputeDouble)) report(w.error_key, ErrorCode::kNonFiniteReward, i);
    if (w.counts[i] == 0) report(w.error_key, ErrorCode::kNoPolicyTokens, i);
    reward_sum += r;
    token_sum += static_cast<double>(w.counts[i]);
  }
  const double rs = Reduce(storage).Sum(reward_sum);
  __syncthreads();
  const double ts = Reduce(storage).Sum(token_sum);
  if (threadIdx.x == 0) {
    shared_sum[0] = rs;
    shared_sum[1] = ts;
    if (p.num_policy_tokens > 0 && p.num_policy_tokens < ts) {
      report(w.error_key, ErrorCode::kTooFewPolicyTokens, static_cast<int64_t>(ts));
    }
  }
  __syncthreads();
  const double baseline = p.has_baseline ? p.baseline : shared_sum[0] / static_cast<double>(batch);
  const double num_policy = p.num_policy_tokens > 0 ? p.num_policy_tokens : shared_sum[1];
  for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
    const double r = load_as_double(p.rewards, p.rewards_dtype, i);
    if (!finite_in_compute(r - baseline, kComputeDouble)) report(w.error_key, ErrorCode::kNonFiniteAdvantage, i);
    const C advantage = static_cast<C>(r - baseline);
    advantages[i] = advantage;
    const int64_t count = w.counts[i];
    policy_tokens[i] = count;
    w.coef[i] = static_cast<double>(advantage) * loss_scale(p.agg, count, p.num_trajectories, num_policy,
                                                            p.loss_scale_factor);
    const bool filter = p.failures != nullptr;
    const KeepPlan plan = keep_plan(filter, filter && p.failures[i], p.q, count);
    if (filter) {
      w.active[i] = plan.mode == kKeepFlags ? 1 : 0;
      if (plan.mode == kKeepFlags) {
        w.remaining[i] = plan.kept;
        w.prefix_e[i] = 0;
        w.prefix_p[i] = 0;
      }
    }
    w.keep[i] = plan.mode;
    w.keep_count[i] = plan.kept;
    w.overflow[i] = kNoError;
    w.grad_overflow[i] = kNoError;
  }
}

template <class E>
__device__ __forceinline__ typename math::EntropyKey<E>::type entropy_key_at(const E* e, int64_t t) {
  using V = typename math::EntropyKey<E>::value;
  return math::entropy_key(static_cast<V>(math::to_compute(e[t], V())));
}

template <class E>
__global__ void check_entropies_kernel(const E* e, const uint8_t* mask, int64_t n, unsigned long long* error_key) {
  if (offsets_invalid(error_key)) return;
  using V = typename math::EntropyKey<E>::value;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const V v = math::to_compute(e[t], V());
    if ((!mask || mask[t]) && !isfinite(v)) report(error_key, ErrorCode::kBadEntropy, t);
  }
}

// Digit `pass` of the composite key (entropy key bits, then 32 bits of ~position): the most
// significant digit first. Returns false when the token's already-fixed digits differ from the
// trajectory's prefix (it is no longer a candidate).
template <class K>
__device__ __forceinline__ bool candidate_digit(K ekey, unsigned int pkey, int pass, unsigned long long prefix_e,
                                                unsigned int prefix_p, unsigned int* digit) {
  constexpr int kEBits = sizeof(K) * 8;
  constexpr int kEPasses = kEBits / kDigitBits;
  const unsigned long long e64 = static_cast<unsigned long long>(ekey);
  if (pass < kEPasses) {
    const int fixed = pass * kDigitBits;
    if (fixed > 0 && (e64 >> (kEBits - fixed)) != prefix_e) return false;
    *digit = static_cast<unsigned int>((e64 >> (kEBits - fixed - kDigitBits)) & (kBins - 1));
    return true;
  }
  if (e64 != prefix_e) return false;
  const int fixed = (pass - kEPasses) * kDigitBits;
  if (fixed > 0 && (pkey >> (32 - fixed)) != prefix_p) return false;
  *digit = (pkey >> (32 - fixed - kDigitBits)) & (kBins - 1);
  return true;
}

template <class E>
__global__ void histogram_kernel(const E* e, const uint8_t* mask, int64_t batch, int64_t n, int pass, Workspace w) {
  if (offsets_invalid(w.error_key)) return;
  using K = typename math::EntropyKey<E>::type;
  __shared__ unsigned int local[kBins];
  int64_t lo, hi;
  tile_segment_range(w.cu, batch, n, &lo, &hi);
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t base = t0 + static_cast<int64_t>(threadIdx.x) * kItems;
  if (base < n) {
    int64_t seg = find_segment(w.cu, lo, hi, base);
    const int64_t end = min(base + kItems, n);
    for (int64_t t = base; t < end; ++t) {
      while (w.cu[seg + 1] <= t) ++seg;
      if (!w.active[seg] || (mask && !mask[t])) continue;
      unsigned int digit;
      const unsigned int pkey = ~static_cast<unsigned int>(t - w.cu[seg]);
      if (!candidate_digit<K>(entropy_key_at(e, t), pkey, pass, w.prefix_e[seg], w.prefix_p[seg], &digit)) continue;
      if (seg == lo) {
        atomicAdd(&local[digit], 1u);
      } else {
        atomicAdd(&w.hist[seg * kBins + digit], 1u);
      }
    }
  }
  __syncthreads();
  if (w.active[lo]) {
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
      if (local[b]) atomicAdd(&w.hist[lo * kBins + b], local[b]);
    }
  }
}

template <class K>
__global__ void resolve_kernel(int64_t batch, int pass, Workspace w) {
  if (offsets_invalid(w.error_key)) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch || !w.active[i]) return;
  constexpr int kEBits = sizeof(K) * 8;
  constexpr int kEPasses = kEBits / kDigitBits;
  unsigned int* h = w.hist + i * kBins;
  int64_t above = 0;
  int bin = kBins - 1;
  for (; bin > 0; --bin) {
    if (above + h[bin] >= w.remaining[i]) break;
    above += h[bin];
  }
  const int64_t remaining = w.remaining[i] - above;
  const int64_t in_bin = h[bin];
  for (int b = 0; b < kBins; ++b) h[b] = 0;
  w.remaining[i] = remaining;
  unsigned long long pe = w.prefix_e[i];
  unsigned int pp = w.prefix_p[i];
  int free_e, free_p;
  if (pass < kEPasses) {
    pe = (pe << kDigitBits) | static_cast<unsigned long long>(bin);
    free_e = kEBits - (pass + 1) * kDigitBits;
    free_p = 32;
  } else {
    pp = (pp << kDigitBits) | static_cast<unsigned int>(bin);
    free_e = 0;
    free_p = 32 - (pass - kEPasses + 1) * kDigitBits;
  }
  w.prefix_e[i] = pe;
  w.prefix_p[i] = pp;
  if (in_bin == remaining) {
    // Every candidate of this bin is kept: the threshold is the bin's smallest composite key.
    w.thr_e[i] = free_e > 0 ? (pe << free_e) : pe;
    w.thr_p[i] = free_p >= 32 ? 0u : (free_p > 0 ? (pp << free_p) : pp);
    w.active[i] = 0;
  }
}

template <class E, class LP>
__global__ void flag_kernel(const E* e, const uint8_t* mask, int64_t batch, int64_t n, Workspace w, LP* grad) {
  if (offsets_invalid(w.error_key)) return;
  using K = typename math::EntropyKey<E>::type;
  int64_t lo, hi;
  tile_segment_range(w.cu, batch, n, &lo, &hi);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
  if (base >= n) return;
  int64_t seg = find_segment(w.cu, lo, hi, base);
  const int64_t end = min(base + kItems, n);
  const LP one = math::Store<LP>::from(1.0f), zero = math::Store<LP>::from(0.0f);
  for (int64_t t = base; t < end; ++t) {
    while (w.cu[seg + 1] <= t) ++seg;
    if (w.keep[seg] != kKeepFlags) continue;
    const unsigned long long ek = static_cast<unsigned long long>(entropy_key_at(e, t));
    const unsigned int pk = ~static_cast<unsigned int>(t - w.cu[seg]);
    const bool kept = (!mask || mask[t]) && (ek > w.thr_e[seg] || (ek == w.thr_e[seg] && pk >= w.thr_p[seg]));
    grad[t] = kept ? one : zero;
  }
}

struct MainParams {
  const uint8_t* mask;
  int64_t batch;
  int64_t n;
  bool no_is;
  bool read_flags;  // some trajectory keeps only flagged tokens (entropy filter)
  GateMetric gate_metric;  // the gate's per-token term
  double truncation;       // importance ratios clipped at this value (inf: not clipped)
};

// The main pass: one tile per block; each thread owns kItems consecutive tokens, loaded and stored
// with vector accesses (load_items / store_items).
// Occupancy: three blocks per SM where log_probs are not float64 (the pass is bound by instruction
// issue and latency more than by bandwidth; the cap costs at most a few bytes of spills there).
template <class LP>
constexpr int main_kernel_min_blocks() { return sizeof(LP) == 8 ? 1 : 3; }

template <class LP, class BLP>
__global__ void __launch_bounds__(kThreads, main_kernel_min_blocks<LP>()) main_kernel(const LP* lp, const BLP* blp, LP* grad, MainParams p,
                                                        Workspace w) {
  if (offsets_invalid(w.error_key)) return;
  using C = typename math::ComputeOf<LP>::type;
  using RawLP = typename Raw<LP>::type;
  using RawBLP = typename Raw<BLP>::type;

  int64_t lo, hi;
  tile_segment_range(w.cu, p.batch, p.n, &lo, &hi);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
  const int mine = items_in_range(base, p.n);
  RawLP lp_raw[kItems];
  RawBLP blp_raw[kItems];
  RawLP flags[kItems];
  uint8_t m[kItems];
  load_items<RawLP>(reinterpret_cast<const RawLP*>(lp) + base, mine, RawLP(0), lp_raw);
  load_items<RawBLP>(reinterpret_cast<const RawBLP*>(blp) + base, mine, RawBLP(0), blp_raw);
  if (p.mask) {
    load_items<uint8_t>(p.mask + base, mine, uint8_t(0), m);
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k) m[k] = 1;
  }
  if (p.read_flags) {
    load_items<RawLP>(reinterpret_cast<const RawLP*>(grad) + base, mine, RawLP(0), flags);
  }

  const bool no_is = p.no_is;
  const bool read_flags = p.read_flags;
  const GateMetric metric = p.gate_metric;
  const C cap = static_cast<C>(p.truncation);  // inf when off: min(rho, inf) is rho
  unsigned long long* error_key = w.error_key;
  RawLP g_raw[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) g_raw[k] = to_raw<LP>(math::Store<LP>::from(0.0f));
  tile_segmented_sums<2>(w.cu, p.n, lo, hi, w.body, w.head, [&](int k, int64_t t, int64_t seg, double* c) {
    const bool policy = m[k] != 0;
    const C x = math::to_compute(from_raw<LP>(lp_raw[k]), C());
    const C y = math::to_compute(from_raw<BLP>(blp_raw[k]), C());
    if (policy && !math::valid_log_prob(x)) report(error_key, ErrorCode::kBadLogProb, t);
    if (policy && !no_is && !math::valid_log_prob(y)) report(error_key, ErrorCode::kBadBehaviorLogProb, t);
    const uint8_t keep = w.keep[seg];
    bool kept = policy && keep != kKeepNone;
    if (read_flags && keep == kKeepFlags) kept = kept && math::to_compute(from_raw<LP>(flags[k]), C()) != C(0);
    C g = C(0);
    double loss = 0.0;
    if (kept) {
      const C raw = no_is ? C(1) : math::exp_c(x - y);
      const C rho = raw < cap ? raw : cap;  // truncated IS; an overflowed ratio becomes the cap
      g = -rho * static_cast<C>(w.coef[seg]);
      if (!isfinite(rho)) {
        atomicMin(&w.overflow[seg], static_cast<unsigned long long>(t));
      } else if (!math::fits_storage<LP>(g)) {
        atomicMin(&w.grad_overflow[seg], static_cast<unsigned long long>(t));
      }
      loss = static_cast<double>(g) * static_cast<double>(x);
    }
    g_raw[k] = to_raw<LP>(math::Store<LP>::from(g));
    c[0] = (policy && !no_is) ? static_cast<double>(math::gate_term(metric, y, x)) : 0.0;
    c[1] = loss;
  });
  store_items<RawLP>(reinterpret_cast<RawLP*>(grad) + base, mine, g_raw);
}

template <class C>
__global__ void finish_trajectories_kernel(int64_t batch, double delta, bool no_is, Workspace w, C* sequence_kl,
                                           uint8_t* admitted, int64_t* retained) {
  if (offsets_invalid(w.error_key)) return;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (i >= batch) return;
  double total[2];
  combine_pieces<2>(w.cu, w.body, w.head, i, total);
  if ((threadIdx.x & 31) != 0) return;
  const int64_t count = w.counts[i];
  const double mean = count > 0 ? total[0] / static_cast<double>(count) : 0.0;
  const C kl = no_is ? C(0) : static_cast<C>(mean > 0.0 ? mean : 0.0);
  const bool ok = static_cast<double>(kl) <= delta;
  sequence_kl[i] = kl;
  admitted[i] = ok;
  retained[i] = ok ? w.keep_count[i] : 0;
  w.loss_terms[i] = ok ? total[1] : 0.0;
  if (ok && w.overflow[i] != kNoError) report(w.error_key, ErrorCode::kRatioOverflow, static_cast<int64_t>(w.overflow[i]));
  if (ok && w.grad_overflow[i] != kNoError) {
    report(w.error_key, ErrorCode::kGradientOverflow, static_cast<int64_t>(w.grad_overflow[i]));
  }
}

template <class LP>
__global__ void zero_rejected_kernel(LP* grad, const uint8_t* admitted, int64_t batch, int64_t n, Workspace w) {
  if (offsets_invalid(w.error_key)) return;
  int64_t lo, hi;
  tile_segment_range(w.cu, batch, n, &lo, &hi);
  // Whole tile admitted (the common case): nothing to do.
  __shared__ int any_rejected;
  if (threadIdx.x == 0) any_rejected = 0;
  __syncthreads();
  for (int64_t s = lo + threadIdx.x; s <= hi; s += blockDim.x) {
    if (!admitted[s]) any_rejected = 1;
  }
  __syncthreads();
  if (!any_rejected) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t t1 = min(t0 + kTile, n);
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    const int64_t seg = find_segment(w.cu, lo, hi, t);
    if (!admitted[seg]) grad[t] = math::Store<LP>::from(0.0f);
  }
}

template <class C>
__global__ void __launch_bounds__(1024) finish_batch_kernel(int64_t batch, Workspace w, const uint8_t* admitted,
                                                            C* loss, C* acceptance, int64_t* error_record) {
  using Reduce = cub::BlockReduce<double, 1024>;
  __shared__ typename Reduce::TempStorage storage;
  const bool valid = !offsets_invalid(w.error_key);
  double sum = 0.0, count = 0.0;
  if (valid) {
    for (int64_t i = threadIdx.x; i < batch; i += blockDim.x) {
      sum += w.loss_terms[i];
      count += admitted[i] ? 1.0 : 0.0;
    }
  }
  const double total = Reduce(storage).Sum(sum);
  __syncthreads();
  const double admitted_count = Reduce(storage).Sum(count);
  if (threadIdx.x == 0) {
    *loss = static_cast<C>(total);
    *acceptance = static_cast<C>(admitted_count / static_cast<double>(batch));
    const unsigned long long key = *w.error_key;
    error_record[0] = key == kNoError ? 0 : static_cast<int64_t>(key >> 56);
    error_record[1] = key == kNoError ? -1 : static_cast<int64_t>(key & ((1ull << 56) - 1));
  }
}

// ---------------------------------------------------------------------------------------------
// Host-side dispatch.

unsigned int blocks_for(int64_t items, int threads) {
  return static_cast<unsigned int>(std::max<int64_t>(1, (items + threads - 1) / threads));
}

template <class E, class LP>
void launch_selection(const LossParams& p, const Workspace& w, int64_t tiles, cudaStream_t stream) {
  using K = typename math::EntropyKey<E>::type;
  const E* e = p.entropies.as<const E>();
  const uint8_t* mask = p.action_mask.as<const uint8_t>();
  const int64_t n = p.num_tokens(), b = p.batch();
  const int passes = static_cast<int>(sizeof(K)) + 4;  // 8-bit digits over (entropy key, position)
  for (int pass = 0; pass < passes; ++pass) {
    histogram_kernel<E><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(e, mask, b, n, pass, w);
    resolve_kernel<K><<<blocks_for(b, 256), 256, 0, stream>>>(b, pass, w);
  }
  flag_kernel<E, LP><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(e, mask, b, n, w, p.grad.as<LP>());
}

template <class E>
void launch_filter(const LossParams& p, const Workspace& w, int64_t tiles, cudaStream_t stream) {
  check_entropies_kernel<E><<<blocks_for(p.num_tokens(), 256 * 8), 256, 0, stream>>>(
      p.entropies.as<const E>(), p.action_mask.as<const uint8_t>(), p.num_tokens(), w.error_key);
  switch (p.log_probs.dtype) {
    case DType::kFloat16: return launch_selection<E, Half>(p, w, tiles, stream);
    case DType::kBFloat16: return launch_selection<E, BFloat16>(p, w, tiles, stream);
    case DType::kFloat32: return launch_selection<E, float>(p, w, tiles, stream);
    default: return launch_selection<E, double>(p, w, tiles, stream);
  }
}

template <class LP, class BLP>
void launch_main(const LossParams& p, const Workspace& w, int64_t tiles, cudaStream_t stream) {
  using C = typename math::ComputeOf<LP>::type;
  const int64_t n = p.num_tokens(), b = p.batch();
  const MainParams mp{p.action_mask.as<const uint8_t>(), b, n, p.options.no_is, p.options.filter(),
                      p.options.gate_metric, p.options.is_truncation};
  main_kernel<LP, BLP><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(
      p.log_probs.as<const LP>(), p.behavior_log_probs.as<const BLP>(), p.grad.as<LP>(), mp, w);
  finish_trajectories_kernel<C><<<blocks_for(b * 32, 256), 256, 0, stream>>>(
      b, p.options.delta, p.options.no_is, w, p.sequence_kl.as<C>(), p.admitted.as<uint8_t>(),
      p.retained_tokens.as<int64_t>());
  zero_rejected_kernel<LP><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(
      p.grad.as<LP>(), p.admitted.as<const uint8_t>(), b, n, w);
}

template <class LP>
void launch_main_lp(const LossParams& p, const Workspace& w, int64_t tiles, cudaStream_t stream) {
  switch (p.behavior_log_probs.dtype) {
    case DType::kFloat16: return launch_main<LP, Half>(p, w, tiles, stream);
    case DType::kBFloat16: return launch_main<LP, BFloat16>(p, w, tiles, stream);
    case DType::kFloat32: return launch_main<LP, float>(p, w, tiles, stream);
    default: return launch_main<LP, double>(p, w, tiles, stream);
  }
}

template <class C>
void launch_trajectories(const LossParams& p, const Workspace& w, cudaStream_t stream) {
  const LossOptions& o = p.options;
  TrajParams tp;
  tp.rewards = p.rewards.data;
  tp.rewards_dtype = p.rewards.dtype;
  tp.failures = o.filter() ? p.failures.as<const uint8_t>() : nullptr;
  tp.q = o.negative_token_fraction;
  tp.has_baseline = o.has_reward_baseline;
  tp.baseline = o.reward_baseline;
  tp.num_trajectories = o.num_trajectories > 0 ? static_cast<double>(o.num_trajectories) : static_cast<double>(p.batch());
  tp.agg = o.loss_agg;
  tp.loss_scale_factor = o.loss_scale_factor;
  tp.num_policy_tokens = static_cast<double>(o.num_policy_tokens);
  trajectory_kernel<C><<<1, 1024, 0, stream>>>(tp, p.batch(), w, p.advantages.as<C>(), p.policy_tokens.as<int64_t>());
}

}  // namespace

bool has_cuda() { return true; }

size_t cuda_workspace_bytes(int64_t num_tokens, int64_t batch, bool filter) {
  const int64_t tiles = (num_tokens + kTile - 1) / kTile;
  return layout(batch, tiles, filter, nullptr).bytes;
}

Error loss_forward_cuda(const LossParams& p, void* workspace, int64_t* error_record, void* stream_handle,
                        bool synchronize_errors) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int64_t n = p.num_tokens(), b = p.batch();
  const int64_t tiles = (n + kTile - 1) / kTile;
  if (tiles > 0x7fffffff) throw std::runtime_error("flashreinforce: too many tokens for one CUDA launch");
  const bool filter = p.options.filter();
  const Workspace w = layout(b, tiles, filter, static_cast<char*>(workspace));
  const bool compute_double = p.log_probs.dtype == DType::kFloat64;
  const uint8_t* mask = p.action_mask.as<const uint8_t>();

  FR_CUDA_CHECK(cudaMemsetAsync(w.error_key, 0xff, sizeof(unsigned long long), stream));
  FR_CUDA_CHECK(cudaMemsetAsync(w.body, 0, sizeof(double) * 2 * b, stream));
  FR_CUDA_CHECK(cudaMemsetAsync(w.head, 0, sizeof(double) * 2 * tiles, stream));
  if (filter) FR_CUDA_CHECK(cudaMemsetAsync(w.hist, 0, sizeof(unsigned int) * kBins * b, stream));

  prepare_offsets_kernel<<<blocks_for(b + 1, 256), 256, 0, stream>>>(
      p.cu_seqlens.data, p.cu_seqlens.dtype == DType::kInt32 ? 1 : 0, p.padded_row_length, b, n, w.cu, w.error_key);
  if (mask) {
    count_kernel<<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(mask, w.cu, b, n, w.body, w.head,
                                                                              w.error_key);
    combine_counts_kernel<<<blocks_for(b * 32, 256), 256, 0, stream>>>(w.cu, b, w.body, w.head, w.counts,
                                                                         w.error_key);
    FR_CUDA_CHECK(cudaMemsetAsync(w.body, 0, sizeof(double) * 2 * b, stream));
    FR_CUDA_CHECK(cudaMemsetAsync(w.head, 0, sizeof(double) * 2 * tiles, stream));
  } else {
    lengths_kernel<<<blocks_for(b, 256), 256, 0, stream>>>(w.cu, b, w.counts, w.error_key);
  }
  if (compute_double) {
    launch_trajectories<double>(p, w, stream);
  } else {
    launch_trajectories<float>(p, w, stream);
  }
  if (filter) {
    switch (p.entropies.dtype) {
      case DType::kFloat16: launch_filter<Half>(p, w, tiles, stream); break;
      case DType::kBFloat16: launch_filter<BFloat16>(p, w, tiles, stream); break;
      case DType::kFloat32: launch_filter<float>(p, w, tiles, stream); break;
      default: launch_filter<double>(p, w, tiles, stream); break;
    }
  }
  switch (p.log_probs.dtype) {
    case DType::kFloat16: launch_main_lp<Half>(p, w, tiles, stream); break;
    case DType::kBFloat16: launch_main_lp<BFloat16>(p, w, tiles, stream); break;
    case DType::kFloat32: launch_main_lp<float>(p, w, tiles, stream); break;
    default: launch_main_lp<double>(p, w, tiles, stream); break;
  }
  const uint8_t* admitted = p.admitted.as<const uint8_t>();
  if (compute_double) {
    finish_batch_kernel<double><<<1, 1024, 0, stream>>>(b, w, admitted, p.loss.as<double>(),
                                                        p.acceptance_rate.as<double>(), error_record);
  } else {
    finish_batch_kernel<float><<<1, 1024, 0, stream>>>(b, w, admitted, p.loss.as<float>(),
                                                       p.acceptance_rate.as<float>(), error_record);
  }
  FR_CUDA_CHECK(cudaGetLastError());

  Error result;
  if (synchronize_errors) {
    int64_t record[2];
    FR_CUDA_CHECK(cudaMemcpyAsync(record, error_record, sizeof(record), cudaMemcpyDeviceToHost, stream));
    FR_CUDA_CHECK(cudaStreamSynchronize(stream));
    result.code = static_cast<ErrorCode>(record[0]);
    result.index = record[1];
  }
  return result;
}

}  // namespace flashreinforce
