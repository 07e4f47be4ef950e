// The collectives of the transport between processes on CUDA: the ranks of a mesh axis are
// processes on one host, one GPU each (the launch of jax.distributed jobs with one process per
// GPU). They meet through the CPU module's shared-memory meeting point and share device memory
// and events by CUDA IPC handles (ipc_participant.h; docs/cuda.md, "Across processes: CUDA
// IPC"). The protocols are the in-process ones (p2p_protocol.h, exact_sum.h). Two processes may share one
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
#include "exact_sum.h"
#include "exchange.h"
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
  protocol::ExactStart s;
  if (ffi::Error e = protocol::BeginExactSum(kOp, stream, x, *y, rank_buf, group_buf, size,
                                             timeout_ms, two_shot, two_shot_bytes, &s);
      e.failure()) {
    return e;
  }
  ffi::Error error = ffi::Error::Success();
  const shm::Api* api = ipc::BoundApi(kOp, &error);
  if (!api) return error;
  IpcParticipant me(api, kOp, stream, s.deadline, site, s.group);
  if (ffi::Error e = me.Join(axes_key, s.rank, size, s.two ? 3 : 2,
                             Describe({4, int64_t(x.element_type()), int64_t(x.element_count()),
                                       size, s.two}),
                             timeout_ms);
      e.failure()) {
    return e;
  }
  auto meet = [&me](int barrier, const void* data, size_t bytes) {
    return me.MeetRegions(barrier, {Region{data, bytes}, Region{}, Region{}});
  };
  return protocol::ExactSum(kOp, me, meet, stream, s.device, site, s.group, s.rank, size, x, *y,
                            s.two);
}

// The ragged exchange among processes of one host over CUDA IPC (exchange.h).
ffi::Error ShmExchange(ffi::RunId, cudaStream_t stream, ffi::AnyBuffer operand,
                       ffi::AnyBuffer output, ffi::Buffer<ffi::S32> input_offsets,
                       ffi::Buffer<ffi::S32> send_sizes, ffi::Buffer<ffi::S32> output_offsets,
                       ffi::Buffer<ffi::S32> recv_sizes, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                       int64_t size, int64_t site, int64_t timeout_ms, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_exchange";
  protocol::ExchangeStart s;
  if (ffi::Error e = protocol::BeginExchange(kOp, stream, rank_buf, group_buf, size, timeout_ms,
                                             &s);
      e.failure()) {
    return e;
  }
  ffi::Error error = ffi::Error::Success();
  const shm::Api* api = ipc::BoundApi(kOp, &error);
  if (!api) return error;
  IpcParticipant me(api, kOp, stream, s.deadline, site, s.group);
  int64_t rows = 0, row_bytes = 0;
  protocol::ExchangeRows(operand, &rows, &row_bytes);
  if (ffi::Error e = me.Join(axes_key, s.rank, size, 3,
                             Describe({9, int64_t(operand.element_type()), row_bytes, size}),
                             timeout_ms);
      e.failure()) {
    return e;
  }
  auto meet = [&me](int barrier, const void* data, size_t bytes) {
    return me.MeetRegions(barrier, {Region{data, bytes}, Region{}, Region{}});
  };
  return protocol::Exchange(kOp, me, meet, stream, s.device, site, s.group, s.rank, size,
                            operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *out);
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
                              flashcomm::bind::Psum<flashcomm::bind::Peers::kShared>(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::RunId>()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommShmExchangeCuda, flashcomm::cuda::ShmExchange,
                              flashcomm::bind::Exchange<flashcomm::bind::Peers::kShared>(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::RunId>()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()));
