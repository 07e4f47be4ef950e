// Host plumbing of the CUDA handlers: CUDA errors and kernel launches' results as ffi::Error (every
// handler file); for the peer-to-peer ones (p2p_handlers.cc, the fused collectives;
// p2p_ring_handlers.cc, the ring steps), a scoped current device, peer access enabled once per
// device pair, and reading the rank and group operands on the host with a deadline. Plain C++ with
// the CUDA runtime API (no nanobind, not compiled by nvcc). Never run on hardware (docs/cuda.md).
#ifndef FLASHCOMM_CUDA_P2P_HOST_H_
#define FLASHCOMM_CUDA_P2P_HOST_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {

namespace ffi = xla::ffi;

inline ffi::Error CudaError(const char* op, const std::string& what, cudaError_t err) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// A kernel launcher's result as the handler's status: Internal, naming the CUDA error.
inline ffi::Error LaunchStatus(const char* op, cudaError_t err) {
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(op, "CUDA kernel launch", err);
}

#define FLASHCOMM_CUDA_TRY(op, what, expr)                           \
  do {                                                               \
    const cudaError_t flashcomm_err_ = (expr);                       \
    if (flashcomm_err_ != cudaSuccess) {                             \
      return ::flashcomm::cuda::CudaError(op, what, flashcomm_err_); \
    }                                                                \
  } while (0)

// Makes a device current on this thread for the scope, restoring the previous one.
class CurrentDevice {
 public:
  CurrentDevice() = default;
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    if (restore_) cudaSetDevice(previous_);
  }
  cudaError_t Set(int device) {
    if (cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) return e;
    if (previous_ == device) return cudaSuccess;
    const cudaError_t e = cudaSetDevice(device);
    restore_ = e == cudaSuccess;
    return e;
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// Peer access from the current device `device` to `peer`, enabled once per ordered pair and
// process. Pairs that cannot access each other are left alone: cudaMemcpyPeerAsync then stages
// the copy through the host (slower, still correct). Peer access XLA (or anyone) enabled
// already is fine.
inline cudaError_t EnablePeerAccess(int device, int peer) {
  if (device == peer) return cudaSuccess;
  static std::mutex mu;
  static auto* done = new std::set<std::pair<int, int>>();  // never destroyed, like Rendezvous
  std::lock_guard<std::mutex> lock(mu);
  if (done->count({device, peer})) return cudaSuccess;
  int can = 0;
  if (cudaError_t e = cudaDeviceCanAccessPeer(&can, device, peer); e != cudaSuccess) return e;
  if (can) {
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not sticky, but it would be the next launcher's "last error"
    } else if (e != cudaSuccess) {
      return e;
    }
  }
  done->insert({device, peer});
  return cudaSuccess;
}

// A cudaMalloc block of at least `bytes` (first `initial`, then doubled), replacing *ptr /
// *capacity when they are smaller; on failure both are left empty. cudaFree waits for the
// device, so no earlier work still uses the old block.
inline cudaError_t GrowDeviceBlock(size_t bytes, size_t initial, void** ptr, size_t* capacity) {
  if (*capacity >= bytes) return cudaSuccess;
  size_t grown = *capacity ? *capacity : initial;
  while (grown < bytes) grown *= 2;
  if (*ptr) cudaFree(*ptr);
  *ptr = nullptr;
  *capacity = 0;
  if (cudaError_t e = cudaMalloc(ptr, grown); e != cudaSuccess) {
    *ptr = nullptr;
    return e;
  }
  *capacity = grown;
  return cudaSuccess;
}

// Device memory of this process for (device, site, group): the collectives' working copies of
// their peers' chunks, grown by GrowDeviceBlock. Calls of one site run in order on their
// device's stream, so reusing the block across calls is stream-ordered. XLA's FFI scratch
// allocator is not used: on jax 0.11.2 it refused even 4864 bytes to these handlers
// (docs/cuda.md).
inline cudaError_t Workspace(int device, int64_t site, int64_t group, size_t bytes, void** ptr) {
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  static std::mutex mu;
  static auto* blocks = new std::map<std::tuple<int, int64_t, int64_t>, Block>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  Block& b = (*blocks)[{device, site, group}];
  if (cudaError_t e = GrowDeviceBlock(bytes, size_t(1) << 16, &b.ptr, &b.bytes);
      e != cudaSuccess) {
    return e;
  }
  *ptr = b.ptr;
  return cudaSuccess;
}

// This thread's pinned 8 bytes for the rank and group scalars (pinned, so that the copy is
// asynchronous and the wait for it can time out; portable, as the thread may serve any device).
inline int32_t* PinnedScalars(cudaError_t* err) {
  struct Pinned {
    int32_t* p = nullptr;
    ~Pinned() {
      if (p) cudaFreeHost(p);
    }
  };
  thread_local Pinned pinned;
  *err = cudaSuccess;
  if (!pinned.p) {
    void* p = nullptr;
    *err = cudaHostAlloc(&p, 2 * sizeof(int32_t), cudaHostAllocPortable);  // any device
    if (*err != cudaSuccess) return nullptr;
    pinned.p = static_cast<int32_t*>(p);
  }
  return pinned.p;
}

// The rank and group operands (device scalars) on the host: copied behind the work already on
// `stream`, then the stream is drained (polled, so that it gives up at `deadline`). This is the
// one host sync per call beyond the barriers (docs/cuda.md).
inline ffi::Error ReadRankAndGroup(const char* op, cudaStream_t stream, const int32_t* rank_dev,
                            const int32_t* group_dev, std::chrono::steady_clock::time_point deadline, int32_t* rank,
                            int32_t* group) {
  cudaError_t err = cudaSuccess;
  int32_t* host = PinnedScalars(&err);
  FLASHCOMM_CUDA_TRY(op, "cudaHostAlloc (rank and group)", err);
  FLASHCOMM_CUDA_TRY(op, "copying the rank to the host",
                     cudaMemcpyAsync(host, rank_dev, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                     stream));
  FLASHCOMM_CUDA_TRY(op, "copying the group to the host",
                     cudaMemcpyAsync(host + 1, group_dev, sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream));
  for (int i = 0;; ++i) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) return CudaError(op, "waiting for the rank and group", q);
    if (std::chrono::steady_clock::now() >= deadline) {
      return ffi::Error::Internal(std::string(op) + ": timed out waiting for the stream to "
                                  "deliver the rank and group operands (timeout_ms)");
    }
    if (i < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  cudaGetLastError();  // cudaErrorNotReady is not an error; make sure no launcher reports it
  *rank = host[0];
  *group = host[1];
  return ffi::Error::Success();
}

// An event one rank records and other ranks' streams wait on, with `users` references; the last
// Release() destroys it (on its device; a cudaStreamWaitEvent already enqueued does not need the
// event to live on). The p2p collectives share it through the meeting (Published slot 3, one
// reference per rank: the owner drops its own after the barrier, each peer after enqueueing
// its wait, and peers read the owner's device from it); the ring steps publish one per move.
class SharedEvent {
 public:
  // A new event on `device` (current), recorded on `stream`, with `users` references.
  static cudaError_t Record(int device, int users, cudaStream_t stream, SharedEvent** out) {
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) {
      cudaEventDestroy(event);
      return e;
    }
    *out = new SharedEvent(event, device, users);
    return cudaSuccess;
  }
  cudaEvent_t event() const { return event_; }
  int device() const { return device_; }
  // Drop `n` references; the last one destroys the event (on its device).
  void Release(int n = 1) {
    if (users_.fetch_sub(n, std::memory_order_acq_rel) == n) {
      CurrentDevice on;
      on.Set(device_);
      cudaEventDestroy(event_);
      delete this;
    }
  }

 private:
  SharedEvent(cudaEvent_t event, int device, int users)
      : event_(event), device_(device), users_(users) {}
  cudaEvent_t event_;
  int device_;
  std::atomic<int> users_;
};

}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_P2P_HOST_H_
