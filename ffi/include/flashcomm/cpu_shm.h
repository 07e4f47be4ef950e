// The CPU peer-to-peer transport between processes on one host (ffi/cpu/shm_kernels.cc): the
// fused quantized collectives and the exact all-reduce over shared memory (shm_rendezvous.h).
#ifndef FLASHCOMM_CPU_SHM_H_
#define FLASHCOMM_CPU_SHM_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmAllReduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmReduceScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmAllGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmPsumCpu);
// Ring steps (ffi/cpu/shm_ring_kernels.cc): start / done of one chunk move around a ring.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmRingStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommShmRingDoneCpu);

#include <cstddef>

namespace flashcomm {
namespace cpu {
// Ring steps this process started and has not finished (0 between collective matmuls).
size_t ShmRingStepsInProgress();
}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_SHM_H_
