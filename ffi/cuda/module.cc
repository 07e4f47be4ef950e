// nanobind module exposing the CUDA handlers as PyCapsules for
// jax.ffi.register_ffi_target(..., platform="CUDA"). Compiled by the host compiler; the CUDA
// runtime is linked statically (cudart_static), so importing it needs no GPU.

#include "handlers.h"
#include "handler_metadata.h"
#include "flashcomm/nb_registrations.h"
#include "cpu/shm_rendezvous.h"

#include <stdexcept>
#include <string>

namespace {

nanobind::dict CudaRegistrations() {
  nanobind::dict d;
#define FLASHCOMM_TARGET(name, stem) d[#name] = flashcomm::HandlerCapsule(Flashcomm##stem##Cuda);
#include "flashcomm/targets.def"
  return d;
}

}  // namespace

NB_MODULE(_flashcomm_cuda, m) {
  m.def("registrations", &CudaRegistrations);
  // What each registered handler declares, read as XLA reads it at registration (the metadata
  // call, handler_metadata.h): tests/gpu/test_gpu_traits.py checks the traits.
  m.def(
      "handler_metadata",
      []() {
        nanobind::dict out;
        for (auto [name, capsule] : CudaRegistrations()) {
          auto* handler = reinterpret_cast<XLA_FFI_Handler*>(
              nanobind::cast<nanobind::capsule>(capsule).data());
          const flashcomm::HandlerMetadata md = flashcomm::QueryHandlerMetadata(handler);
          out[name] = nanobind::make_tuple(md.ok, md.api_major, md.api_minor, md.traits);
        }
        return out;
      },
      "target name -> (answered, FFI API major, minor, traits) of every registered handler.");
  m.attr("TRAIT_COMMAND_BUFFER_COMPATIBLE") =
      uint32_t(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
  m.def("p2p_meetings_in_progress", &flashcomm::cuda::P2pMeetingsInProgress,
        "Peer-to-peer collective calls some rank has not finished (0 between collectives).");
  m.def(
      "shm_bind",
      [](nanobind::capsule api) {
        if (std::string(api.name() ? api.name() : "") != "flashcomm.shm.Api") {
          throw std::invalid_argument("shm_bind: not the CPU module's shm_api() capsule");
        }
        const auto* entry = static_cast<const flashcomm::shm::Api*>(api.data());
        if (entry->version != flashcomm::shm::kApiVersion) {
          throw std::invalid_argument("shm_bind: the CPU module's meeting point is version " +
                                      std::to_string(entry->version) + ", this module's " +
                                      std::to_string(flashcomm::shm::kApiVersion));
        }
        flashcomm::cuda::ShmBind(entry);
      },
      "Binds the CPU module's shared-memory meeting point (its shm_api() capsule).");
  m.def("shm_bound", &flashcomm::cuda::ShmBound,
        "Whether the shared-memory meeting point is bound (shm_bind).");
  m.def("shm_signal_channels", &flashcomm::cuda::ShmSignalChannels,
        "Signal words (one per site, group and barrier) this process has given out.");
  m.def("shm_ring_steps_in_progress", &flashcomm::cuda::ShmRingStepsInProgress,
        "Ring steps between processes this process started and has not finished.");
  m.def("shm_peer_buffers_mapped", &flashcomm::cuda::ShmPeerBuffersMapped,
        "Peers' CUDA IPC staging buffers this process has mapped.");
  flashcomm::AddP2pRingInspection(
      m, &flashcomm::cuda::P2pRingStepsInProgress,
      "Returns and clears the ring steps' recorded events (kind 0 move, 1 start, 2 wait; "
      "site, rank, peer, bytes, begin_us, end_us; host times: a move's is its enqueueing, "
      "not the copy) and records from now on if `record`.");
}
