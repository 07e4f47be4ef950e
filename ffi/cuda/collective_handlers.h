// The quantized collectives' FFI handlers on CUDA, written once over who the peers are: each
// checks its operands, has `Peers::Begin` find the device, rank and group, allocate the working
// memory and join the call, then runs the protocol of p2p_protocol.h with the participant that
// made. p2p_handlers.cc instantiates them for the GPUs of one process (the in-process
// rendezvous, events and peer copies), shm_handlers.cc for processes of one host (the CPU
// module's shared-memory meeting point and CUDA IPC; the trailing `Key` is its axes_key).
// Their bindings: flashcomm/bindings.h.
#ifndef FLASHCOMM_CUDA_COLLECTIVE_HANDLERS_H_
#define FLASHCOMM_CUDA_COLLECTIVE_HANDLERS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "cpu/shm_rendezvous.h"
#include "flashcomm/codec.h"
#include "flashcomm/group_format.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {

namespace ffi = xla::ffi;

// What a quantized collective holds from Peers::Begin to its end: the device made current, the
// rank and group read from device memory, the working memory and this rank's participant.
template <typename Participant>
struct Begun {
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  protocol::ScratchPayload gathered;
  std::unique_ptr<Participant> me;

  // What every Peers::Begin does before it joins: the device, rank and group
  // (protocol::Start), then `slots` of `slot_groups` groups of `nb` bytes of working memory.
  ffi::Error Start(const char* op, cudaStream_t stream, ffi::Buffer<ffi::S32> rank_buf,
                   ffi::Buffer<ffi::S32> group_buf, int64_t size, int64_t site,
                   protocol::Clock::time_point deadline, int64_t slots, int64_t slot_groups,
                   int64_t nb) {
    if (ffi::Error e = protocol::Start(op, stream, rank_buf, group_buf, size, deadline, &on,
                                       &device, &rank, &group);
        e.failure()) {
      return e;
    }
    return protocol::AllocateWork(op, device, site, group, slots, slot_groups, nb, &gathered);
  }
};

template <typename Peers, typename... Key>
ffi::Error AllReduceHandler(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                            AnyOut y, U8Out p1_codes, Bf16Out p1_scale, Bf16Out p1_zero,
                            U8Out p2_codes, Bf16Out p2_scale, Bf16Out p2_zero, GroupFormat fmt,
                            GroupFormat out_fmt, int64_t size, int64_t site, int64_t timeout_ms,
                            Key... key) {
  constexpr const char* kOp = Peers::kAllReduce;
  const int64_t g = fmt.group_size;
  protocol::Codec k;
  bool decode = false;
  if (ffi::Error e = protocol::CheckAllReduce(kOp, x, *y, *p1_codes, *p1_scale, *p1_zero,
                                              *p2_codes, *p2_scale, *p2_zero, fmt.bits,
                                              out_fmt.bits, g, fmt.rotation, fmt.spikes,
                                              out_fmt.spikes, size, timeout_ms, &k, &decode);
      e.failure()) {
    return e;
  }
  const uint64_t descriptor =
      shm::Describe({1, int64_t(k.dtype), k.n_groups, g, fmt.bits, out_fmt.bits, fmt.rotation,
                     fmt.spikes, out_fmt.spikes, decode, size});
  Begun<typename Peers::Participant> b;  // slots: chunk `rank` of every peer's phase-1 payload
  if (ffi::Error e = Peers::Begin(kOp, run, stream, rank_buf, group_buf, size, site, timeout_ms,
                                  key..., 3, descriptor, size, k.n_groups / size,
                                  record_bytes(g, fmt.bits, fmt.spikes), &b);
      e.failure()) {
    return e;
  }
  return protocol::AllReduce(kOp, *b.me, stream, b.gathered, k, b.rank, x.untyped_data(),
                             y->untyped_data(), decode, p1_codes->typed_data(),
                             p1_scale->typed_data(), p1_zero->typed_data(),
                             p2_codes->typed_data(), p2_scale->typed_data(),
                             p2_zero->typed_data());
}

// reduce_scatter (kAllGather false) and all_gather: x -> y and this rank's payload.
template <bool kAllGather, typename Peers, typename... Key>
ffi::Error PayloadHandler(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf, AnyOut y,
                          U8Out codes, Bf16Out scale, Bf16Out zero, GroupFormat fmt, int64_t size,
                          int64_t site, int64_t timeout_ms, Key... key) {
  constexpr const char* kOp = kAllGather ? Peers::kAllGather : Peers::kReduceScatter;
  const int64_t g = fmt.group_size;
  protocol::Codec k;
  if (ffi::Error e = protocol::CheckPayloadCollective(kOp, kAllGather, x, *y, *codes, *scale,
                                                      *zero, fmt.bits, g, fmt.rotation,
                                                      fmt.spikes, size, timeout_ms, &k);
      e.failure()) {
    return e;
  }
  const uint64_t descriptor = shm::Describe({kAllGather ? 3 : 2, int64_t(k.dtype), k.n_groups, g,
                                             fmt.bits, fmt.rotation, fmt.spikes, size});
  // The slots: every peer's payload (all-gather; this rank's unused), or chunk `rank` of it.
  Begun<typename Peers::Participant> b;
  if (ffi::Error e = Peers::Begin(kOp, run, stream, rank_buf, group_buf, size, site, timeout_ms,
                                  key..., 2, descriptor, size,
                                  kAllGather ? k.n_groups : k.n_groups / size,
                                  record_bytes(g, fmt.bits, fmt.spikes), &b);
      e.failure()) {
    return e;
  }
  if constexpr (kAllGather) {
    return protocol::AllGather(kOp, *b.me, stream, b.gathered, k, b.rank, x.untyped_data(),
                               x.size_bytes(), y->untyped_data(), codes->typed_data(),
                               scale->typed_data(), zero->typed_data());
  } else {
    return protocol::ReduceScatter(kOp, *b.me, stream, b.gathered, k, b.rank, x.untyped_data(),
                                   y->untyped_data(), codes->typed_data(), scale->typed_data(),
                                   zero->typed_data());
  }
}

}  // namespace cuda
}  // namespace flashcomm

// The three quantized collectives' handler symbols `Flashcomm<Prefix>AllReduceCuda`, ...
// ReduceScatterCuda and ...AllGatherCuda among `kPeers` (bindings.h), from the templates above.
// The contexts: the run id, then the device's stream. No traits (not command-buffer safe: the
// files that use this say why).
#define FLASHCOMM_DEFINE_CUDA_COLLECTIVES(Prefix, kPeers, ...)                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##AllReduceCuda, (flashcomm::cuda::AllReduceHandler<__VA_ARGS__>),     \
      flashcomm::bind::AllReduce<kPeers>(                                                     \
          xla::ffi::Ffi::Bind()                                                               \
              .Ctx<xla::ffi::RunId>()                                                         \
              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##ReduceScatterCuda,                                                   \
      (flashcomm::cuda::PayloadHandler<false, __VA_ARGS__>),                                  \
      flashcomm::bind::ReduceScatter<kPeers>(                                                 \
          xla::ffi::Ffi::Bind()                                                               \
              .Ctx<xla::ffi::RunId>()                                                         \
              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##AllGatherCuda, (flashcomm::cuda::PayloadHandler<true, __VA_ARGS__>), \
      flashcomm::bind::ReduceScatter<kPeers>(                                                 \
          xla::ffi::Ffi::Bind()                                                               \
              .Ctx<xla::ffi::RunId>()                                                         \
              .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()))

#endif  // FLASHCOMM_CUDA_COLLECTIVE_HANDLERS_H_
