// The CPU peer-to-peer transport (ffi/cpu/p2p_kernels.cc): fused quantized collectives whose
// ranks are the virtual CPU devices of one process, meeting in p2p_rendezvous.h.
#ifndef FLASHCOMM_CPU_P2P_H_
#define FLASHCOMM_CPU_P2P_H_

#include <cstddef>

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pAllReduceCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pReduceScatterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pAllGatherCpu);
// Ring steps (ffi/cpu/p2p_ring_kernels.cc): start / done of one chunk move around a ring.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pRingStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommP2pRingDoneCpu);

namespace flashcomm {
namespace cpu {

// Meetings not yet finished by every rank (zero between collectives; tests check no leak).
size_t P2pMeetingsInProgress();
// Ring steps some rank has not finished (zero between collective matmuls).
size_t P2pRingStepsInProgress();

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_P2P_H_
