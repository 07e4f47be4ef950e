// nanobind module exposing the CPU handlers as PyCapsules for jax.ffi.register_ffi_target, and
// the choice of the codec's instruction-set build (cpu_dispatch.h).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/cpu_dispatch.h"
#include "cpu/handlers.h"
#include "cpu/cpu_parallel.h"
#include "cpu/shm_rendezvous.h"
#include "flashcomm/nb_registrations.h"

namespace {

// The shared-memory transport's blocks, meetings and emulated bus (jax_flashcomm/transport/shm.py).
void AddShmFunctions(nanobind::module_& m) {
  m.def(
      "shm_create_block",
      [](int64_t process_index) {
        flashcomm::shm::BlockId id;
        std::string error;
        if (!flashcomm::shm::CreateBlock(process_index, &id, &error)) {
          throw std::runtime_error("shared-memory transport: " + error);
        }
        return std::make_tuple(id.pid, id.fd);
      },
      "Creates this process's shared-memory block (once) and returns its (pid, fd).");
  m.def(
      "shm_attach",
      [](const std::vector<std::tuple<int64_t, int64_t, int64_t>>& blocks) {
        std::vector<flashcomm::shm::BlockId> ids;
        for (const auto& [index, pid, fd] : blocks) ids.push_back({index, pid, fd});
        std::string error;
        if (!flashcomm::shm::AttachBlocks(ids, &error)) {
          throw std::runtime_error("shared-memory transport: " + error);
        }
      },
      "Maps the blocks (process_index, pid, fd) of every process of the job on this host.");
  m.def(
      "shm_api",
      []() {
        return nanobind::capsule(static_cast<const void*>(flashcomm::shm::GetApi()),
                                 "flashcomm.shm.Api");
      },
      "The meeting point's entry points (a capsule) for the CUDA module's shm_bind().");
  m.def("shm_attached", &flashcomm::shm::AttachedProcesses,
        "Processes whose shared-memory blocks this process has mapped.");
  m.def("shm_meetings_in_progress", &flashcomm::shm::InProgress,
        "Shared-memory collective calls not finished (0 between collectives).");
  m.def("shm_ring_steps_in_progress", &flashcomm::cpu::ShmRingStepsInProgress,
        "Shared-memory ring steps this process started and has not finished.");
  m.def(
      "shm_set_link_rate",
      [](double bytes_per_s) {
        if (!(bytes_per_s >= 0)) throw std::invalid_argument("link rate must be >= 0 bytes/s");
        flashcomm::shm::SetLinkRate(bytes_per_s);
      },
      "Emulate a bus of this many bytes/s shared by the host's ranks (0: none; benchmarks).");
  m.def("shm_link_rate", &flashcomm::shm::LinkRate, "The emulated bus's bytes/s (0: none).");
  m.def("shm_name_site", &flashcomm::shm::NameSite, nanobind::arg("site"), nanobind::arg("text"),
        "Publishes a call site's description for the errors of peers (after shm_create_block).");
  m.def("shm_segments", &flashcomm::shm::SegmentsMapped,
        "Shared segments this process owns or maps (blocks excluded).");
}

// The codec kernels' instruction-set build and threads (jax_flashcomm/codec/kernels.py).
void AddCodecFunctions(nanobind::module_& m) {
  m.def("cpu_isa", []() { return std::string(flashcomm::cpu::kernels().isa); },
        "The instruction-set build the codec kernels run (avx512, avx2, baseline or neon).");
  m.def("supported_isas", &flashcomm::cpu::supported_isas,
        "The builds this CPU can run, best first.");
  m.def("cpu_features", &flashcomm::cpu::cpu_features,
        "The vector features the CPU reports, as text.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        const std::string error = flashcomm::cpu::set_isa(name);
        if (!error.empty()) throw std::invalid_argument(error);
      },
      "Run the codec kernels with the named build from now on ('auto': the best supported).");
  m.def("isa_pass_seconds", &flashcomm::cpu::pass_seconds, nanobind::arg("isa"),
        nanobind::arg("groups"), nanobind::arg("reps"),
        "Median seconds of the all-reduce's three codec passes with build `isa` (-1: it cannot "
        "run here).");
  m.def("cpu_threads", []() { return flashcomm::cpu::max_codec_threads().load(); },
        "At most this many threads per codec call (0: every thread of XLA's intra-op pool).");
  m.def("cpu_split_calls", []() { return flashcomm::cpu::split_calls().load(); },
        "Codec calls split over more than one thread so far (for tests).");
  m.def(
      "set_cpu_threads",
      [](int threads) {
        if (threads < 0) throw std::invalid_argument("cpu threads must be >= 0 (0: the pool's)");
        flashcomm::cpu::max_codec_threads().store(threads);
      },
      "Split each codec call over at most `threads` threads from now on (0: the whole pool).");
}

}  // namespace

NB_MODULE(_flashcomm_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
#define FLASHCOMM_TARGET(name, stem) d[#name] = flashcomm::HandlerCapsule(Flashcomm##stem##Cpu);
#include "flashcomm/targets.def"
    return d;
  });
  m.def("p2p_meetings_in_progress", &flashcomm::cpu::P2pMeetingsInProgress,
        "Peer-to-peer collective calls some rank has not finished (0 between collectives).");
  AddShmFunctions(m);
  flashcomm::AddP2pRingInspection(
      m, &flashcomm::cpu::P2pRingStepsInProgress,
      "Returns and clears the ring steps' recorded events (kind 0 move, 1 start, 2 wait; "
      "site, rank, peer, bytes, begin_us, end_us) and records from now on if `record`.");
  AddCodecFunctions(m);
}
