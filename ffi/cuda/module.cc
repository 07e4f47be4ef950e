// nanobind module exposing the CUDA handlers as PyCapsules for
// jax.ffi.register_ffi_target(..., platform="CUDA"). Compiled by the host compiler; the CUDA
// runtime is linked statically (cudart_static), so importing it needs no GPU.
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>
#include <vector>

#include "flashcomm/cuda_kernels.h"
#include "flashcomm/nb_registrations.h"
#include "flashcomm/p2p_ring.h"

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
  m.def("p2p_ring_steps_in_progress", &flashcomm::cuda::P2pRingStepsInProgress,
        "Ring steps (start / done pairs) some rank has not finished (0 between calls).");
  // The CPU module's p2p_timeline; on CUDA every time is the host's (a move's is its
  // enqueueing, not the copy).
  m.def(
      "p2p_timeline",
      [](bool record) {
        std::vector<std::tuple<int, int64_t, int, int, int64_t, int64_t, int64_t>> out;
        for (const auto& e : flashcomm::p2p::Timeline::Global().Take(record)) {
          out.emplace_back(e.kind, e.site, e.rank, e.peer, e.bytes, e.begin_us, e.end_us);
        }
        return out;
      },
      "Returns and clears the ring steps' recorded events (kind 0 move, 1 start, 2 wait; "
      "site, rank, peer, bytes, begin_us, end_us; host times) and records from now on if "
      "`record`.");
}
