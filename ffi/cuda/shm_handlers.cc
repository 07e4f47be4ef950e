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

#include "flashcomm/codec.h"
#include "flashcomm/cuda_kernels.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/shm_rendezvous.h"
#include "ipc_participant.h"
#include "launch.h"
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

// What the three quantized handlers do before their protocol: the meeting point, the device,
// the rank and group, working memory, the call joined.
struct Begun {
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  protocol::ScratchPayload gathered;
};

ffi::Error Begin(const char* op, cudaStream_t stream,
                 ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf, int64_t size,
                 int64_t site, int64_t timeout_ms, int64_t axes_key, int barriers,
                 uint64_t descriptor, int64_t slots, int64_t slot_groups, int64_t nb,
                 Begun* b, std::unique_ptr<IpcParticipant>* me) {
  ffi::Error error = ffi::Error::Success();
  const shm::Api* api = ipc::BoundApi(op, &error);
  if (!api) return error;
  const auto deadline = p2p::DeadlineAfter(timeout_ms);
  if (ffi::Error e = protocol::Start(op, stream, rank_buf, group_buf, size, deadline, &b->on,
                                     &b->device, &b->rank, &b->group);
      e.failure()) {
    return e;
  }
  if (ffi::Error e =
          protocol::AllocateWork(op, b->device, site, b->group, slots, slot_groups, nb,
                                 &b->gathered);
      e.failure()) {
    return e;
  }
  *me = std::make_unique<IpcParticipant>(api, op, stream, deadline, site, b->group);
  return (*me)->Join(axes_key, b->rank, size, barriers, descriptor, timeout_ms);
}

}  // namespace

ffi::Error ShmAllReduce(cudaStream_t stream, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero,
                        ffi::Result<ffi::Buffer<ffi::U8>> p2_codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p2_scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p2_zero, int32_t bits,
                        int32_t out_bits, int64_t group_size, int32_t rotation, int32_t spikes,
                        int32_t out_spikes, int64_t size, int64_t site, int64_t timeout_ms,
                        int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_all_reduce";
  protocol::Codec k;
  bool decode = false;
  if (ffi::Error e = protocol::CheckAllReduce(kOp, x, *y, *p1_codes, *p1_scale, *p1_zero,
                                              *p2_codes, *p2_scale, *p2_zero, bits, out_bits,
                                              group_size, rotation, spikes, out_spikes, size,
                                              timeout_ms, &k, &decode);
      e.failure()) {
    return e;
  }
  Begun b;
  std::unique_ptr<IpcParticipant> me;
  const uint64_t descriptor = Describe({1, int64_t(k.dtype), k.n_groups, group_size, bits,
                                        out_bits, rotation, spikes, out_spikes, decode, size});
  if (ffi::Error e = Begin(kOp, stream, rank_buf, group_buf, size, site, timeout_ms,
                           axes_key, 3, descriptor, size, k.n_groups / size,
                           record_bytes(group_size, bits, spikes), &b, &me);
      e.failure()) {
    return e;
  }
  return protocol::AllReduce(kOp, *me, stream, b.gathered, k, b.rank, x.untyped_data(),
                             y->untyped_data(), decode, p1_codes->typed_data(),
                             p1_scale->typed_data(), p1_zero->typed_data(),
                             p2_codes->typed_data(), p2_scale->typed_data(),
                             p2_zero->typed_data());
}

ffi::Error ShmReduceScatter(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                            ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                            ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                            int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                            int64_t site, int64_t timeout_ms, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_reduce_scatter";
  protocol::Codec k;
  if (ffi::Error e = protocol::CheckReduceScatter(kOp, x, *y, *codes, *scale, *zero, bits,
                                                  group_size, rotation, spikes, size,
                                                  timeout_ms, &k);
      e.failure()) {
    return e;
  }
  Begun b;
  std::unique_ptr<IpcParticipant> me;
  const uint64_t descriptor = Describe({2, int64_t(k.dtype), k.n_groups, group_size, bits,
                                        rotation, spikes, size});
  if (ffi::Error e = Begin(kOp, stream, rank_buf, group_buf, size, site, timeout_ms,
                           axes_key, 2, descriptor, size, k.n_groups / size,
                           record_bytes(group_size, bits, spikes), &b, &me);
      e.failure()) {
    return e;
  }
  return protocol::ReduceScatter(kOp, *me, stream, b.gathered, k, b.rank, x.untyped_data(),
                                 y->untyped_data(), codes->typed_data(), scale->typed_data(),
                                 zero->typed_data());
}

ffi::Error ShmAllGather(cudaStream_t stream, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                        int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                        int64_t site, int64_t timeout_ms, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_all_gather";
  protocol::Codec k;
  if (ffi::Error e = protocol::CheckAllGather(kOp, x, *y, *codes, *scale, *zero, bits,
                                              group_size, rotation, spikes, size, timeout_ms,
                                              &k);
      e.failure()) {
    return e;
  }
  Begun b;
  std::unique_ptr<IpcParticipant> me;
  const uint64_t descriptor = Describe({3, int64_t(k.dtype), k.n_groups, group_size, bits,
                                        rotation, spikes, size});
  if (ffi::Error e = Begin(kOp, stream, rank_buf, group_buf, size, site, timeout_ms,
                           axes_key, 2, descriptor, size, k.n_groups,
                           record_bytes(group_size, bits, spikes), &b, &me);
      e.failure()) {
    return e;
  }
  return protocol::AllGather(kOp, *me, stream, b.gathered, k, b.rank, x.untyped_data(),
                             x.size_bytes(), y->untyped_data(), codes->typed_data(),
                             scale->typed_data(), zero->typed_data());
}

// The exact all-reduce: one shot (every rank sums every rank's x) or two shots (rank r sums
// chunk r, then every rank copies every chunk), the f32 rank-order sum of the CPU handler.
ffi::Error ShmPsum(cudaStream_t stream, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                   ffi::Result<ffi::AnyBuffer> y, int64_t size, int64_t site,
                   int64_t timeout_ms, int64_t axes_key, int32_t two_shot,
                   int64_t two_shot_bytes) {
  constexpr const char* kOp = "flashcomm_shm_psum";
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

// The same operands, results and attributes as the CPU handlers (ffi/cpu/shm_kernels.cc), in
// the same order; the context adds the stream. No traits: NOT
// command-buffer compatible (see p2p_handlers.cc).
#define FLASHCOMM_SHM_COMMON_ATTRS                                                         \
  .Attr<int64_t>("size")          /* ranks in the replica group */                         \
      .Attr<int64_t>("site")      /* the call site: peers of one call share it */          \
      .Attr<int64_t>("timeout_ms") /* every wait gives up after this, with an error */     \
      .Attr<int64_t>("axes_key")  /* the mesh axes (a hash of their names) */

#define FLASHCOMM_SHM_CUDA_CONTEXT \
  .Ctx<ffi::PlatformStream<cudaStream_t>>() /* this device's stream */

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommShmAllReduceCuda, flashcomm::cuda::ShmAllReduce,
    ffi::Ffi::Bind() FLASHCOMM_SHM_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: x's shape and dtype, the decoded sum (or empty)
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-1 codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 zero
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-2 codes, gathered: (N * gpc, bytes')
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 scale: (N * gpc)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 zero
        .Attr<int32_t>("bits")             // phase-1 code width, 2..8
        .Attr<int32_t>("out_bits")         // phase-2 code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2 (both phases)
        .Attr<int32_t>("spikes")           // phase-1 spikes per group, 0..16
        .Attr<int32_t>("out_spikes")       // phase-2 spikes per group, 0..16
        FLASHCOMM_SHM_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommShmReduceScatterCuda, flashcomm::cuda::ShmReduceScatter,
    ffi::Ffi::Bind() FLASHCOMM_SHM_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (groups_per_chunk, group_size), chunk `rank`
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_SHM_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommShmAllGatherCuda, flashcomm::cuda::ShmAllGather,
    ffi::Ffi::Bind() FLASHCOMM_SHM_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (groups, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (N, groups, group_size), rank j's in slot j
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (groups, bytes), this rank's payload
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (groups)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_SHM_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommShmPsumCuda, flashcomm::cuda::ShmPsum,
    ffi::Ffi::Bind() FLASHCOMM_SHM_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: any shape, f32, bf16 or f16
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: x's shape and dtype, the exact sum
        FLASHCOMM_SHM_COMMON_ATTRS
        .Attr<int32_t>("two_shot")         // 0: every rank sums all; 1: reduce-scatter + gather;
                                           // 2: two shots from two_shot_bytes
        .Attr<int64_t>("two_shot_bytes"));  // with 2: two shots from this many bytes per rank
