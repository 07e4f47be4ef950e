// What both nanobind modules (CPU, CUDA) export alike: the registrations() dict (target name ->
// capsule of the XLA FFI handler, the names of targets.def on every platform) and the ring
// steps' inspection functions. Host-only (never included by .cu).
#ifndef FLASHCOMM_NB_REGISTRATIONS_H_
#define FLASHCOMM_NB_REGISTRATIONS_H_

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "flashcomm/p2p_ring.h"

#include "xla/ffi/api/c_api.h"

namespace flashcomm {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// A handler as registrations() gives it, for jax.ffi.register_ffi_target. Each module fills its
// dict from targets.def:
//   #define FLASHCOMM_TARGET(name, stem) d[#name] = HandlerCapsule(Flashcomm##stem##Cpu);
//   #include "flashcomm/targets.def"
inline nanobind::capsule HandlerCapsule(Handler* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// The ring steps' inspection functions of a kernel module: `p2p_ring_steps_in_progress` and
// `p2p_timeline` (the module's own p2p::Timeline; `timeline_doc`, a string literal, says what
// its times are).
inline void AddP2pRingInspection(nanobind::module_& m, size_t (*steps_in_progress)(),
                                 const char* timeline_doc) {
  m.def("p2p_ring_steps_in_progress", steps_in_progress,
        "Ring steps (start / done pairs) some rank has not finished (0 between calls).");
  m.def(
      "p2p_timeline",
      [](bool record) {
        std::vector<std::tuple<int, int64_t, int, int, int64_t, int64_t, int64_t>> out;
        for (const auto& e : p2p::Timeline::Global().Take(record)) {
          out.emplace_back(e.kind, e.site, e.rank, e.peer, e.bytes, e.begin_us, e.end_us);
        }
        return out;
      },
      timeline_doc);
}

}  // namespace flashcomm

#endif  // FLASHCOMM_NB_REGISTRATIONS_H_
