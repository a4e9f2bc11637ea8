// CUDA kernel of echo::select_budget: a bit-for-bit twin of echo_vllm.core.budget.select_budget_reference.
//
// Depends only on the CUDA runtime (`nvcc -c csrc/budget_cuda.cu` works without torch or a GPU); the torch
// binding lives in budget_cuda_binding.cpp. Design (see csrc/README.md):
//
//   one launch, one block of 1024 threads for the whole batch (the selection is global across requests):
//   1. class + 64-bit order key of every node (budget_key.h), kept in shared memory when B*N*9 bytes fit
//      (else in a global workspace); block reduction of the class-0 / class-1 counts c0, c1;
//   2. the class boundary follows from c0, c1, k_max; inside the boundary class, an MSB-first radix select
//      (8 passes of 8 bits at most, warp-aggregated shared-memory histograms, early exit as soon as the
//      k-th node's bucket is taken whole) finds the threshold key T;
//   3. marking pass (key < T or <= T), then, only when several nodes share T and not all of them are in, a
//      tiled block scan in flat-index order takes the first ones (the order's last tie-breaker);
//   4. per-row compaction, one warp per row: ballots give `order`; parent positions are a binary search in
//      the (ascending) order row.
#include "budget_cuda.h"

#include <mutex>

#include "budget_key.h"

namespace echo {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxDevices = 64;

static_assert(kWarps == 32, "the block reductions assume 32 warps of 32 lanes");
static_assert(kBins == 8 * 32, "the bucket search gives 8 bins to each lane of one warp");

enum Mode : int {
  kModeAll = 0,         // k_max >= c0 + c1: every eligible node
  kModeBelowClass = 1,  // the boundary class contributes nothing: class < cb
  kModeLessEqual = 2,   // class < cb, or class == cb and key <= threshold
  kModeTies = 3,        // class < cb, or class == cb and key < threshold, plus the first tie_take ties
};

struct Shared {
  unsigned hist[kBins];
  unsigned long long warp_sum[kWarps];
  unsigned warp_a[kWarps];
  unsigned warp_b[kWarps];
  unsigned digit;
  unsigned before;
  unsigned bucket;
  unsigned tile_total;
  unsigned running;
};

__device__ __forceinline__ unsigned long long block_sum(unsigned long long value, Shared& sh, int lane, int warp) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_down_sync(kFull, value, offset);
  }
  if (lane == 0) {
    sh.warp_sum[warp] = value;
  }
  __syncthreads();
  unsigned long long total = sh.warp_sum[lane];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    total += __shfl_xor_sync(kFull, total, offset);
  }
  __syncthreads();
  return total;
}

// Inclusive scan over the 32 lanes of a warp.
__device__ __forceinline__ unsigned warp_inclusive_scan(unsigned value, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned other = __shfl_up_sync(kFull, value, offset);
    if (lane >= offset) {
      value += other;
    }
  }
  return value;
}

__global__ void __launch_bounds__(kThreads) select_budget_kernel(BudgetCudaArgs a, int keys_in_smem) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ Shared sh;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int batch = a.batch;
  const int num_nodes = a.num_nodes;
  const unsigned total = static_cast<unsigned>(batch) * static_cast<unsigned>(num_nodes);

  unsigned long long* keys = keys_in_smem ? reinterpret_cast<unsigned long long*>(dyn_smem)
                                          : reinterpret_cast<unsigned long long*>(a.workspace);
  unsigned char* cls = reinterpret_cast<unsigned char*>(keys + total);

  // ---- 1. classes, keys, class counts --------------------------------------------------------------------
  unsigned long long packed = 0;  // c0 in the low word, c1 in the high word (each < 2^31)
  for (unsigned i = static_cast<unsigned>(tid); i < total; i += kThreads) {
    const unsigned b = i / static_cast<unsigned>(num_nodes);
    const float score = a.scores[i];
    const int32_t depth = a.depth[i];
    const uint8_t c = budget::candidate_class(a.valid[i] != 0, a.spine[i] != 0, a.truncated[b] != 0, depth,
                                              a.depth_cap[b], score);
    cls[i] = c;
    keys[i] = budget::order_key(score, depth);
    packed += (c == budget::kClassDepth) ? 1ull : ((c == budget::kClassWidth) ? (1ull << 32) : 0ull);
  }
  packed = block_sum(packed, sh, lane, warp);  // also orders the cls/keys writes before every read below
  const long long c0 = static_cast<long long>(packed & 0xffffffffull);
  const long long c1 = static_cast<long long>(packed >> 32);

  // ---- 2. boundary class and threshold -------------------------------------------------------------------
  const long long k_max = a.k_max;
  int mode = kModeAll;
  unsigned cb = 0;    // boundary class
  unsigned need = 0;  // nodes of class cb to take, 0 < need < count of class cb when mode is LessEqual
  if (k_max < c0 + c1) {
    cb = (k_max >= c0) ? 1u : 0u;
    need = static_cast<unsigned>(cb ? k_max - c0 : k_max);
    mode = need == 0 ? kModeBelowClass : kModeLessEqual;
  }

  unsigned long long threshold = 0;
  unsigned tie_take = 0;
  if (mode == kModeLessEqual) {
    unsigned remaining = need;  // rank (1-based) of the last node to take, within the current bucket
    unsigned long long prefix = 0;
    bool resolved = false;
    for (int shift = 64 - kRadixBits; shift >= 0; shift -= kRadixBits) {
      const int high = shift + kRadixBits;
      const unsigned long long high_mask = high >= 64 ? 0ull : (~0ull << high);
      if (tid < kBins) {
        sh.hist[tid] = 0;
      }
      __syncthreads();
      // Warp-uniform loop so that every lane reaches the full-mask match.
      for (unsigned base = static_cast<unsigned>(warp) * 32u; base < total; base += kThreads) {
        const unsigned i = base + static_cast<unsigned>(lane);
        bool take = false;
        unsigned digit = kBins;  // sentinel: never matches a real digit of a lane that takes
        if (i < total && cls[i] == cb) {
          const unsigned long long key = keys[i];
          if (((key ^ prefix) & high_mask) == 0ull) {
            take = true;
            digit = static_cast<unsigned>(key >> shift) & (kBins - 1u);
          }
        }
        if (__any_sync(kFull, take)) {
          const unsigned peers = __match_any_sync(kFull, digit);
          if (take && lane == __ffs(peers) - 1) {
            atomicAdd(&sh.hist[digit], static_cast<unsigned>(__popc(peers)));
          }
        }
      }
      __syncthreads();
      if (warp == 0) {
        unsigned bins[8];
        unsigned sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          bins[j] = sh.hist[lane * 8 + j];
          sum += bins[j];
        }
        const unsigned inclusive = warp_inclusive_scan(sum, lane);
        const unsigned exclusive = inclusive - sum;
        if (exclusive < remaining && remaining <= inclusive) {  // exactly one lane
          unsigned before = exclusive;
          unsigned found_digit = 0;
          unsigned found_before = 0;
          unsigned found_bucket = 0;
          bool found = false;
#pragma unroll
          for (int j = 0; j < 8; ++j) {  // unrolled, so that bins[] stays in registers
            if (!found) {
              if (remaining <= before + bins[j]) {
                found = true;
                found_digit = static_cast<unsigned>(lane * 8 + j);
                found_before = before;
                found_bucket = bins[j];
              } else {
                before += bins[j];
              }
            }
          }
          sh.digit = found_digit;
          sh.before = found_before;
          sh.bucket = found_bucket;
        }
      }
      __syncthreads();
      // The next writes to sh.digit/before/bucket come after two more barriers: no extra barrier needed.
      remaining -= sh.before;
      prefix |= static_cast<unsigned long long>(sh.digit) << shift;
      if (remaining == sh.bucket) {  // the whole bucket is in
        threshold = prefix | (shift == 0 ? 0ull : ((1ull << shift) - 1ull));
        resolved = true;
        break;
      }
    }
    if (!resolved) {  // several nodes share the exact key `prefix`; take the first `remaining` by flat index
      threshold = prefix;
      tie_take = remaining;
      mode = kModeTies;
    }
  }

  // ---- 3. selection mask ---------------------------------------------------------------------------------
  for (unsigned i = static_cast<unsigned>(tid); i < total; i += kThreads) {
    const unsigned c = cls[i];
    bool sel;
    if (mode == kModeAll) {
      sel = c != budget::kClassExcluded;
    } else if (mode == kModeBelowClass) {
      sel = c < cb;
    } else if (mode == kModeLessEqual) {
      sel = c < cb || (c == cb && keys[i] <= threshold);
    } else {
      sel = c < cb || (c == cb && keys[i] < threshold);
    }
    a.selected[i] = sel ? 1 : 0;
  }
  if (mode == kModeTies) {
    if (tid == 0) {
      sh.running = 0;
    }
    __syncthreads();
    for (unsigned tile = 0; tile < total; tile += kThreads) {  // block-uniform
      const unsigned i = tile + static_cast<unsigned>(tid);
      const bool tie = i < total && cls[i] == cb && keys[i] == threshold;
      const unsigned ballot = __ballot_sync(kFull, tie);
      if (lane == 0) {
        sh.warp_a[warp] = static_cast<unsigned>(__popc(ballot));
      }
      __syncthreads();
      if (warp == 0) {
        const unsigned count = sh.warp_a[lane];
        const unsigned inclusive = warp_inclusive_scan(count, lane);
        sh.warp_b[lane] = inclusive - count;
        if (lane == 31) {
          sh.tile_total = inclusive;
        }
      }
      __syncthreads();
      const unsigned running = sh.running;
      if (tie) {
        const unsigned rank = running + sh.warp_b[warp] + static_cast<unsigned>(__popc(ballot & lanes_below));
        if (rank < tie_take) {
          a.selected[i] = 1;  // the same thread wrote 0 there in the marking pass
        }
      }
      const unsigned next = running + sh.tile_total;
      __syncthreads();  // everyone has read running / warp_b / tile_total
      if (tid == 0) {
        sh.running = next;
      }
      if (next >= tie_take) {
        break;
      }
    }
  }
  __syncthreads();  // `selected` complete and visible to the whole block

  // ---- 4. per-row compaction, one warp per row -----------------------------------------------------------
  for (int b = warp; b < batch; b += kWarps) {
    const size_t row = static_cast<size_t>(b) * static_cast<size_t>(num_nodes);
    const uint8_t* sel_row = a.selected + row;
    int32_t* order_row = a.order + row;
    int count = 0;
    for (int chunk = 0; chunk < num_nodes; chunk += 32) {  // warp-uniform
      const int n = chunk + lane;
      const bool sel = n < num_nodes && sel_row[n] != 0;
      const unsigned ballot = __ballot_sync(kFull, sel);
      if (sel) {
        order_row[count + __popc(ballot & lanes_below)] = n;
      }
      count += __popc(ballot);
    }
    if (lane == 0) {
      a.counts[b] = count;
    }
    __syncwarp();  // order_row[0, count) visible to the whole warp
    for (int j = lane; j < num_nodes; j += 32) {
      if (j < count) {
        const int n = order_row[j];
        const int p = a.parent[row + n];
        int local = -1;
        if (p >= 0 && p < num_nodes && sel_row[p] != 0) {
          int lo = 0;
          int hi = count;  // order_row is ascending; find p in [lo, hi)
          while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (order_row[mid] < p) {
              lo = mid + 1;
            } else {
              hi = mid;
            }
          }
          local = lo;
        }
        a.parent_local[row + j] = local;
        a.order_depth[row + j] = a.depth[row + n];
      } else {
        order_row[j] = -1;
        a.parent_local[row + j] = -1;
        a.order_depth[row + j] = 0;
      }
    }
  }
}

struct DeviceLimits {
  size_t smem_limit;  // dynamic shared bytes available to one block of this kernel
  bool attribute_set;
};

DeviceLimits g_limits[kMaxDevices] = {};
std::mutex g_limits_mutex;

// The current device must be `device` (cudaFuncGetAttributes/SetAttribute act on it).
cudaError_t device_limits(int device, DeviceLimits** out) {
  if (device < 0 || device >= kMaxDevices) {
    return cudaErrorInvalidDevice;
  }
  std::lock_guard<std::mutex> lock(g_limits_mutex);
  DeviceLimits& limits = g_limits[device];
  if (!limits.attribute_set) {
    int optin = 0;
    cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) {
      return err;
    }
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, select_budget_kernel);
    if (err != cudaSuccess) {
      return err;
    }
    const size_t static_bytes = attr.sharedSizeBytes;
    const size_t limit = static_cast<size_t>(optin) > static_bytes ? static_cast<size_t>(optin) - static_bytes : 0;
    err = cudaFuncSetAttribute(select_budget_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(limit));
    if (err != cudaSuccess) {
      return err;
    }
    limits.smem_limit = limit;
    limits.attribute_set = true;
  }
  *out = &limits;
  return cudaSuccess;
}

size_t key_bytes(int64_t num_candidates) {
  return static_cast<size_t>(num_candidates) * (sizeof(unsigned long long) + 1);
}

}  // namespace

size_t budget_cuda_workspace_bytes(int64_t num_candidates, int device) {
  DeviceLimits* limits = nullptr;
  if (device_limits(device, &limits) != cudaSuccess) {
    return key_bytes(num_candidates);  // the launch reports the error
  }
  const size_t bytes = key_bytes(num_candidates);
  return bytes <= limits->smem_limit ? 0 : bytes;
}

cudaError_t budget_cuda_launch(const BudgetCudaArgs& args, cudaStream_t stream) {
  if (args.batch <= 0) {
    return cudaSuccess;  // nothing to write
  }
  if (args.num_nodes < 0 || args.k_max < 0 ||
      static_cast<int64_t>(args.batch) * static_cast<int64_t>(args.num_nodes) > 0x7fffffffLL) {
    return cudaErrorInvalidValue;
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    return err;
  }
  DeviceLimits* limits = nullptr;
  err = device_limits(device, &limits);
  if (err != cudaSuccess) {
    return err;
  }
  const size_t bytes = key_bytes(static_cast<int64_t>(args.batch) * args.num_nodes);
  const bool in_smem = bytes <= limits->smem_limit;
  if (!in_smem && args.workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  select_budget_kernel<<<1, kThreads, in_smem ? bytes : 0, stream>>>(args, in_smem ? 1 : 0);
  return cudaGetLastError();
}

}  // namespace echo
