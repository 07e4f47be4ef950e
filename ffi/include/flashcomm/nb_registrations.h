// The registrations() dict both nanobind modules (CPU, CUDA) export: target name -> capsule of
// the XLA FFI handler, the same names on every platform. Host-only (never included by .cu).
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

inline nanobind::dict Registrations(Handler* quantize, Handler* dequantize,
                                    Handler* dequantize_sum, Handler* dequantize_sum_quantize,
                                    Handler* dequantize_into) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  nanobind::dict d;
  d["flashcomm_quantize"] = capsule(quantize);
  d["flashcomm_dequantize"] = capsule(dequantize);
  d["flashcomm_dequantize_sum"] = capsule(dequantize_sum);
  d["flashcomm_dequantize_sum_quantize"] = capsule(dequantize_sum_quantize);
  d["flashcomm_dequantize_into"] = capsule(dequantize_into);
  return d;
}

// The peer-to-peer transport's fused collectives (docs/transport.md), added to `d`.
inline void AddP2pRegistrations(nanobind::dict& d, Handler* all_reduce, Handler* reduce_scatter,
                                Handler* all_gather) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  d["flashcomm_p2p_all_reduce"] = capsule(all_reduce);
  d["flashcomm_p2p_reduce_scatter"] = capsule(reduce_scatter);
  d["flashcomm_p2p_all_gather"] = capsule(all_gather);
}

// The peer-to-peer transport between processes over shared memory (docs/transport.md, "Across
// processes"), added to `d`.
inline void AddShmRegistrations(nanobind::dict& d, Handler* all_reduce, Handler* reduce_scatter,
                                Handler* all_gather, Handler* psum, Handler* ring_start,
                                Handler* ring_done) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  d["flashcomm_shm_all_reduce"] = capsule(all_reduce);
  d["flashcomm_shm_reduce_scatter"] = capsule(reduce_scatter);
  d["flashcomm_shm_all_gather"] = capsule(all_gather);
  d["flashcomm_shm_psum"] = capsule(psum);
  d["flashcomm_shm_ring_start"] = capsule(ring_start);
  d["flashcomm_shm_ring_done"] = capsule(ring_done);
}

// The floating-point group formats (docs/format.md, "Floating-point formats"), added to `d`.
inline void AddFpRegistrations(nanobind::dict& d, Handler* quantize, Handler* dequantize,
                               Handler* dequantize_sum, Handler* dequantize_sum_quantize) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  d["flashcomm_fp_quantize"] = capsule(quantize);
  d["flashcomm_fp_dequantize"] = capsule(dequantize);
  d["flashcomm_fp_dequantize_sum"] = capsule(dequantize_sum);
  d["flashcomm_fp_dequantize_sum_quantize"] = capsule(dequantize_sum_quantize);
}

// The fused all-reduce epilogue (docs/fused_norm.md), added to `d`.
inline void AddNormRegistrations(nanobind::dict& d, Handler* add_rms_norm,
                                 Handler* add_rms_norm_quantize) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  d["flashcomm_add_rms_norm"] = capsule(add_rms_norm);
  d["flashcomm_add_rms_norm_quantize"] = capsule(add_rms_norm_quantize);
}

// The ring steps of the collective matmuls (docs/transport.md, "Ring steps"), added to `d`.
inline void AddP2pRingRegistrations(nanobind::dict& d, Handler* start, Handler* done) {
  auto capsule = [](Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  d["flashcomm_p2p_ring_start"] = capsule(start);
  d["flashcomm_p2p_ring_done"] = capsule(done);
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
