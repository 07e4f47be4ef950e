// nanobind module exposing the CUDA handlers as PyCapsules for
// jax.ffi.register_ffi_target(..., platform="CUDA"). Compiled by the host compiler; the CUDA
// runtime is linked statically (cudart_static), so importing it needs no GPU.

#include "flashcomm/cuda_kernels.h"
#include "flashcomm/nb_registrations.h"

NB_MODULE(_flashcomm_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d = flashcomm::Registrations(FlashcommQuantizeCuda, FlashcommDequantizeCuda,
                                                FlashcommDequantizeSumCuda,
                                                FlashcommDequantizeSumQuantizeCuda,
                                                FlashcommDequantizeIntoCuda);
    flashcomm::AddP2pRegistrations(d, FlashcommP2pAllReduceCuda, FlashcommP2pReduceScatterCuda,
                                   FlashcommP2pAllGatherCuda);
    flashcomm::AddP2pRingRegistrations(d, FlashcommP2pRingStartCuda, FlashcommP2pRingDoneCuda);
    return d;
  });
  m.def("p2p_meetings_in_progress", &flashcomm::cuda::P2pMeetingsInProgress,
        "Peer-to-peer collective calls some rank has not finished (0 between collectives).");
  flashcomm::AddP2pRingInspection(
      m, &flashcomm::cuda::P2pRingStepsInProgress,
      "Returns and clears the ring steps' recorded events (kind 0 move, 1 start, 2 wait; "
      "site, rank, peer, bytes, begin_us, end_us; host times: a move's is its enqueueing, "
      "not the copy) and records from now on if `record`.");
}
