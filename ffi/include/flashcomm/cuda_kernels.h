// Declarations of the CUDA FFI handler symbols (defined in ffi/cuda/codec_handlers.cc,
// ffi/cuda/gather_handlers.cc for FlashcommDequantizeIntoCuda, ffi/cuda/p2p_handlers.cc and
// ffi/cuda/p2p_ring_handlers.cc for the peer-to-peer transport's FlashcommP2p*Cuda; the kernels
// they launch are in ffi/cuda/*.cu).
// Deliberately free of CUDA headers: ffi/cuda/module.cc (nanobind, host compiler) includes it.
#ifndef FLASHCOMM_CUDA_KERNELS_H_
#define FLASHCOMM_CUDA_KERNELS_H_

#include <cstddef>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeIntoCuda);
// The floating-point formats (ffi/cuda/fp_handlers.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeSumCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeSumQuantizeCuda);
// The fused all-reduce epilogue (ffi/cuda/norm_handlers.cc, docs/fused_norm.md).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommAddRmsNormCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommAddRmsNormQuantizeCuda);
// The peer-to-peer transport (docs/cuda.md, "Peer-to-peer transport (not run on hardware)").
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pAllReduceCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pReduceScatterCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pAllGatherCuda);
// Ring steps (ffi/cuda/p2p_ring_handlers.cc): start / done of one chunk move around a ring.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pRingStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pRingDoneCuda);
// The transport between processes, one GPU each (ffi/cuda/shm_handlers.cc): the CPU module's
// shared-memory meeting point, CUDA IPC memory and event handles.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmAllReduceCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmReduceScatterCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmAllGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmPsumCuda);
// Ring steps between processes (ffi/cuda/shm_ring_handlers.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmRingStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmRingDoneCuda);

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

#endif  // FLASHCOMM_CUDA_KERNELS_H_
