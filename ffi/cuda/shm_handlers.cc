// The collectives of the transport between processes on CUDA: the ranks of a mesh axis are
// processes on one host, one GPU each (the launch of jax.distributed jobs with one process per
// GPU). They meet through the CPU module's shared-memory meeting point and share device memory
// and events by CUDA IPC handles (ipc_participant.h; docs/cuda.md, "Across processes: CUDA
// IPC"). The protocols are the in-process ones (p2p_protocol.h). Two processes may share one
// GPU (CUDA IPC allows it; NCCL does not): that is how one lent GPU tests it
// (tests/gpu/test_gpu_shm.py).
//
// Plain C++ (host compiler, CUDA runtime API). Not CUDA-graph safe (host reads and meetings per
// call): no command-buffer trait.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "flashcomm/bindings.h"
#include "flashcomm/codec.h"
#include "handlers.h"
#include "flashcomm/ffi_checks.h"
#include "cpu/shm_rendezvous.h"
#include "ipc_participant.h"
#include "launch.h"
#include "collective_handlers.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

using ipc::IpcParticipant;
using ipc::Region;
using shm::Describe;

// Processes of one host: they meet at the CPU module's shared-memory meeting point (keyed by
// the mesh axes, with the call's descriptor) and share device memory and events by CUDA IPC.
struct SharedPeers {
  using Participant = IpcParticipant;
  static constexpr const char* kAllReduce = "flashcomm_shm_all_reduce";
  static constexpr const char* kReduceScatter = "flashcomm_shm_reduce_scatter";
  static constexpr const char* kAllGather = "flashcomm_shm_all_gather";
  static ffi::Error Begin(const char* op, const ffi::RunId&, cudaStream_t stream,
                          ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                          int64_t size, int64_t site, int64_t timeout_ms, int64_t axes_key,
                          int barriers, uint64_t descriptor, int64_t slots, int64_t slot_groups,
                          int64_t nb, Begun<Participant>* b) {
    ffi::Error error = ffi::Error::Success();
    const shm::Api* api = ipc::BoundApi(op, &error);
    if (!api) return error;
    const auto deadline = p2p::DeadlineAfter(timeout_ms);
    if (ffi::Error e = b->Start(op, stream, rank_buf, group_buf, size, site, deadline, slots,
                                slot_groups, nb);
        e.failure()) {
      return e;
    }
    b->me = std::make_unique<IpcParticipant>(api, op, stream, deadline, site, b->group);
    return b->me->Join(axes_key, b->rank, size, barriers, descriptor, timeout_ms);
  }
};

}  // namespace

ffi::Error ShmPsum(ffi::RunId, cudaStream_t stream, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                   ffi::Result<ffi::AnyBuffer> y, int64_t size, int64_t site,
                   int64_t timeout_ms, int64_t axes_key, int32_t two_shot,
                   int64_t two_shot_bytes) {
  constexpr const char* kOp = "flashcomm_shm_psum";
  // long function: the exact all-reduce's checks and its one- and two-shot protocol, barrier by
  // barrier
  const ffi::DataType dtype = x.element_type();
  if (size < 1 || size > 1024) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": size must be in 1..1024");
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": " + p2p::TimeoutError(timeout_ms));
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::F16) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": x must be f32, bf16 or f16");
  }
  if (y->element_count() != x.element_count() || y->element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": y must be x's shape");
  }
  if (two_shot < 0 || two_shot > 2) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": two_shot must be 0, 1 or 2");
  }
  ffi::Error error = ffi::Error::Success();
  const shm::Api* api = ipc::BoundApi(kOp, &error);
  if (!api) return error;
  const int64_t count = int64_t(x.element_count());
  const size_t item = dtype == ffi::F32 ? 4 : 2;
  const bool two = two_shot == 2 ? int64_t(x.size_bytes()) >= two_shot_bytes : two_shot == 1;
  const auto deadline = p2p::DeadlineAfter(timeout_ms);
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  if (ffi::Error e = protocol::Start(kOp, stream, rank_buf, group_buf, size, deadline, &on,
                                     &device, &rank, &group);
      e.failure()) {
    return e;
  }
  auto bound = [count, size](int64_t j) { return count * j / size; };
  const int64_t lo = two ? bound(rank) : 0, hi = two ? bound(rank + 1) : count;
  const size_t slot = size_t(hi - lo) * item;
  uint8_t* stacked = nullptr;  // every rank's [lo, hi), rank-major
  if (slot * size_t(size) > 0) {
    void* mem = nullptr;
    FLASHCOMM_CUDA_TRY(kOp, "allocating working memory",
                       Workspace(device, site, group, slot * size_t(size), &mem));
    stacked = static_cast<uint8_t*>(mem);
  }
  IpcParticipant me(api, kOp, stream, deadline, site, group);
  if (ffi::Error e = me.Join(axes_key, rank, size, two ? 3 : 2,
                             Describe({4, int64_t(dtype), count, size, two}), timeout_ms);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me.MeetRegions(0, {Region{x.untyped_data(), x.size_bytes()}, Region{},
                                        Region{}});
      e.failure()) {
    return e;
  }
  for (int j = 0; j < size && slot > 0; ++j) {
    FLASHCOMM_CUDA_TRY(kOp, "copying a peer's values",
                       me.Copy(stream, stacked + j * slot, j,
                               static_cast<const uint8_t*>(me.peers()[j][0]) + lo * item, slot));
  }
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  const auto sum = [&](auto tag) {
    using T = typename decltype(tag)::type;
    return LaunchSumRanks<T>(stream, stacked, hi - lo, int(size), hi - lo, out + lo * item);
  };
  FLASHCOMM_CUDA_TRY(kOp, "sum launch",
                     dtype == ffi::F32    ? sum(protocol::Tag<F32>{})
                     : dtype == ffi::BF16 ? sum(protocol::Tag<BF16>{})
                                          : sum(protocol::Tag<F16>{}));
  if (!two) return me.MeetRegions(1, {});
  if (ffi::Error e = me.MeetRegions(1, {Region{out + lo * item, slot}, Region{}, Region{}});
      e.failure()) {
    return e;
  }
  for (int j = 0; j < size; ++j) {
    if (j == rank || bound(j + 1) == bound(j)) continue;
    FLASHCOMM_CUDA_TRY(kOp, "copying a peer's sum",
                       me.Copy(stream, out + bound(j) * item, j, me.peers()[j][0],
                               size_t(bound(j + 1) - bound(j)) * item));
  }
  return me.MeetRegions(2, {});
}

void ShmBind(const void* api) {
  ipc::g_api.store(static_cast<const shm::Api*>(api), std::memory_order_release);
}
bool ShmBound() { return ipc::g_api.load(std::memory_order_acquire) != nullptr; }
size_t ShmPeerBuffersMapped() { return ipc::IpcState::Global().Mapped(); }
size_t ShmSignalChannels() { return ipc::IpcState::Global().SignalChannels(); }

}  // namespace cuda
}  // namespace flashcomm

// The bindings of the CPU handlers (flashcomm/bindings.h); the contexts add the stream. No
// traits: NOT command-buffer compatible (see p2p_handlers.cc).
FLASHCOMM_DEFINE_CUDA_COLLECTIVES(Shm, flashcomm::bind::Peers::kShared,
                                  flashcomm::cuda::SharedPeers, int64_t);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommShmPsumCuda, flashcomm::cuda::ShmPsum,
                              flashcomm::bind::Psum(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::RunId>()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()));
