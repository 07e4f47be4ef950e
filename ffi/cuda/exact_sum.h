// The exact all-reduce on CUDA (docs/cuda.md), the CPU's (ffi/cpu/cpu_exact_sum.h) value for
// value: every rank's x summed in f32 in rank order and rounded once to the dtype. One shot:
// every rank copies every peer's x and sums all of it; two shots: rank r copies chunk r of
// every x, sums it into its own y, and then copies the other chunks from their owners' y.
// Written once over a participant (p2p_protocol.h's interface): the GPUs of one process
// (p2p_handlers.cc, flashcomm_p2p_psum) and processes of one host over CUDA IPC
// (shm_handlers.cc, flashcomm_shm_psum). `meet(barrier, data, bytes)` publishes one region of
// device memory (or none) at a barrier and orders this stream after every peer's.
// Plain C++ with the CUDA runtime API (host compiler).
#ifndef FLASHCOMM_CUDA_EXACT_SUM_H_
#define FLASHCOMM_CUDA_EXACT_SUM_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "launch.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {
namespace protocol {

// The exact all-reduce's operand checks (both handlers').
inline ffi::Error CheckExactSum(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                int64_t size, int64_t timeout_ms, int32_t two_shot) {
  const ffi::DataType dtype = x.element_type();
  if (size < 1 || size > 1024) {
    return ffi::Error::InvalidArgument(std::string(op) + ": size must be in 1..1024");
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + p2p::TimeoutError(timeout_ms));
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::F16) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32, bf16 or f16");
  }
  if (y.element_count() != x.element_count() || y.element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(op) + ": y must be x's shape");
  }
  if (two_shot < 0 || two_shot > 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": two_shot must be 0, 1 or 2");
  }
  return ffi::Error::Success();
}

// What both handlers find before they join: the device made current, the rank and group read
// from device memory, the deadline and whether to take two shots.
struct ExactStart {
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  bool two = false;
  Clock::time_point deadline;
};

// The checks, then ExactStart's fields (protocol::Start reads the rank and group).
inline ffi::Error BeginExactSum(const char* op, cudaStream_t stream, const ffi::AnyBuffer& x,
                                const ffi::AnyBuffer& y, ffi::Buffer<ffi::S32> rank_buf,
                                ffi::Buffer<ffi::S32> group_buf, int64_t size,
                                int64_t timeout_ms, int32_t two_shot, int64_t two_shot_bytes,
                                ExactStart* s) {
  if (ffi::Error e = CheckExactSum(op, x, y, size, timeout_ms, two_shot); e.failure()) return e;
  s->two = two_shot == 2 ? int64_t(x.size_bytes()) >= two_shot_bytes : two_shot == 1;
  s->deadline = p2p::DeadlineAfter(timeout_ms);
  return Start(op, stream, rank_buf, group_buf, size, s->deadline, &s->on, &s->device, &s->rank,
               &s->group);
}

// The protocol, after the handler has joined `me` to a meeting of `two ? 3 : 2` barriers;
// `device`, `site`, `group` for the working memory.
template <class P, class Meet>
ffi::Error ExactSum(const char* op, P& me, Meet meet, cudaStream_t stream, int device,
                    int64_t site, int32_t group, int32_t rank, int64_t size,
                    const ffi::AnyBuffer& x, ffi::AnyBuffer& y, bool two) {
  const ffi::DataType dtype = x.element_type();
  const int64_t count = int64_t(x.element_count());
  const size_t item = dtype == ffi::F32 ? 4 : 2;
  auto bound = [count, size](int64_t j) { return count * j / size; };
  const int64_t lo = two ? bound(rank) : 0, hi = two ? bound(rank + 1) : count;
  const size_t slot = size_t(hi - lo) * item;
  uint8_t* stacked = nullptr;  // every rank's [lo, hi), rank-major
  if (slot * size_t(size) > 0) {
    void* mem = nullptr;
    FLASHCOMM_CUDA_TRY(op, "allocating working memory",
                       Workspace(device, site, group, slot * size_t(size), &mem));
    stacked = static_cast<uint8_t*>(mem);
  }
  if (ffi::Error e = meet(0, x.untyped_data(), x.size_bytes()); e.failure()) return e;
  if (ffi::Error e = me.Prepare(); e.failure()) return e;
  for (int j = 0; j < size && slot > 0; ++j) {
    FLASHCOMM_CUDA_TRY(op, "copying a peer's values",
                       me.Copy(stream, stacked + j * slot, j,
                               static_cast<const uint8_t*>(me.peers()[j][0]) + lo * item, slot));
  }
  auto* out = static_cast<uint8_t*>(y.untyped_data());
  const auto sum = [&](auto tag) {
    using T = typename decltype(tag)::type;
    return LaunchSumRanks<T>(stream, stacked, hi - lo, int(size), hi - lo, out + lo * item);
  };
  FLASHCOMM_CUDA_TRY(op, "sum launch",
                     dtype == ffi::F32    ? sum(Tag<F32>{})
                     : dtype == ffi::BF16 ? sum(Tag<BF16>{})
                                          : sum(Tag<F16>{}));
  if (!two) return meet(1, nullptr, 0);
  if (ffi::Error e = meet(1, out + lo * item, slot); e.failure()) return e;
  for (int j = 0; j < size; ++j) {
    if (j == rank || bound(j + 1) == bound(j)) continue;
    FLASHCOMM_CUDA_TRY(op, "copying a peer's sum",
                       me.Copy(stream, out + bound(j) * item, j, me.peers()[j][0],
                               size_t(bound(j + 1) - bound(j)) * item));
  }
  return meet(2, nullptr, 0);
}

}  // namespace protocol
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_EXACT_SUM_H_
