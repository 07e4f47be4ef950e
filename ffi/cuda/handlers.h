// The CUDA FFI handler symbols, Flashcomm<stem>Cuda for every target of flashcomm/targets.def
// (defined in the *_handlers.cc files of ffi/cuda; the kernels they launch are in
// ffi/cuda/*.cu), and the functions module.cc exposes. Deliberately free of CUDA headers:
// module.cc (nanobind, host compiler) includes it.
#ifndef FLASHCOMM_CUDA_HANDLERS_H_
#define FLASHCOMM_CUDA_HANDLERS_H_

#include <cstddef>

#include "xla/ffi/api/api.h"

#define FLASHCOMM_TARGET(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(Flashcomm##stem##Cuda);
#include "flashcomm/targets.def"

// Defines Flashcomm<stem>Cuda: `fn` bound by flashcomm::bind::<Op> (flashcomm/bindings.h) after
// the device's stream, and declared command-buffer compatible (docs/cuda.md, "Command
// buffers"): for the handlers that enqueue kernels only.
#define FLASHCOMM_CUDA_STREAM_HANDLER(stem, fn, Op)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                         \
      Flashcomm##stem##Cuda, fn,                                                         \
      flashcomm::bind::Op(                                                               \
          xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),          \
      {xla::ffi::Traits::kCmdBufferCompatible})

// Defines Flashcomm<Prefix>RingStartCuda and ...RingDoneCuda: flashcomm::cuda::<Prefix>RingStart
// and <Prefix>RingDone, bound by bind::RingStart / RingDone<kPeers> after `binding`'s contexts.
// No traits (not command-buffer safe: p2p_ring_handlers.cc says why).
#define FLASHCOMM_DEFINE_CUDA_RING(Prefix, kPeers, binding)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Flashcomm##Prefix##RingStartCuda,                           \
                                flashcomm::cuda::Prefix##RingStart,                         \
                                flashcomm::bind::RingStart<kPeers>(binding));              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Flashcomm##Prefix##RingDoneCuda,                            \
                                flashcomm::cuda::Prefix##RingDone,                          \
                                flashcomm::bind::RingDone<kPeers>(binding))

namespace flashcomm {
namespace cuda {

// Peer-to-peer meetings not yet finished by every rank, in this module's own rendezvous table
// (zero between collectives).
size_t P2pMeetingsInProgress();
// Ring steps some rank has not finished, in this module's own ring table (zero between
// collective matmuls).
size_t P2pRingStepsInProgress();
// The shared-memory meeting point's entry points (a flashcomm::shm::Api* from the CPU module's
// shm_api capsule): the flashcomm_shm_* handlers fail until it is bound.
void ShmBind(const void* api);
bool ShmBound();
// Ring steps between processes this process started and has not finished.
size_t ShmRingStepsInProgress();
// Peers' IPC staging buffers this process has mapped (for tests).
size_t ShmPeerBuffersMapped();
// Signal words (one per site, group and barrier) this process has given out (for tests).
size_t ShmSignalChannels();

}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_HANDLERS_H_
