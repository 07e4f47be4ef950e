// Ring steps of the peer-to-peer transport on CPU (docs/transport.md, "Ring steps"): the
// collective matmuls' chunk moves as a start / done pair of FFI calls, so that XLA runs the
// step's dot while the transport's copy threads move the chunk (p2p_ring.h). The ranks are the
// virtual CPU devices of one process.
//
// start: publishes this rank's send buffer (its result `send_out`, aliased to the operand) and
// its receive buffer (the result `recv`), hands the moves this makes possible to the
// CopyEngine and returns at once: the data in `recv` is not there yet. Steps are staged: a
// rank whose receiver has not started yet sends into a staging buffer at once. Its `order` result (a
// zero) is added to the offset of the slice the step's dot reads where the dot does not read
// the chunk itself (the reduce-scatter ring), so that the dot depends on the start by data.
// done: takes `recv`, the send buffer and the step's dot result (`after`), so XLA can run it
// only after the dot and keeps both buffers alive until it completes; it returns a future that
// completes once the chunk has arrived and this rank's send buffer has been read, and passes
// `recv` and `after` through (aliased) for what comes next.
#include "cpu/handlers.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "cpu/cpu_ops.h"
#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/bindings.h"
#include "flashcomm/p2p_ring.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

using p2p::CopyEngine;
using p2p::Move;
using p2p::RingTable;
using p2p::Timeline;

using p2p::Prefix;

ffi::Error CheckRank(const char* op, int32_t rank, int64_t size, int64_t shift) {
  if (size < 1 || rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument(Prefix(op) + "rank " + std::to_string(rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  if (shift % size == 0 && size > 1) {
    return ffi::Error::InvalidArgument(Prefix(op) + "shift " + std::to_string(shift) +
                                       " sends every chunk to itself");
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error P2pRingStart(ffi::RunId run, ffi::AnyBuffer send, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> send_out,
                        ffi::Result<ffi::AnyBuffer> recv, ffi::Result<ffi::Buffer<ffi::S32>> order,
                        int64_t size, int64_t shift,
                        int64_t site, int64_t timeout_ms, int64_t link_bytes_per_s) {
  constexpr const char* kOp = "flashcomm_p2p_ring_start";
  const int64_t begin_us = Timeline::NowMicros();
  const int32_t rank = rank_buf.typed_data()[0];
  if (ffi::Error e = CheckRank(kOp, rank, size, shift); e.failure()) return e;
  if (ffi::Error e =
          CheckRingStartArgs(kOp, send, *send_out, *recv, timeout_ms, link_bytes_per_s);
      e.failure()) {
    return e;
  }
  PassThrough(send, *send_out);
  order->typed_data()[0] = 0;
  std::string error;
  auto step = RingTable::Global().Start({run.run_id, site, group_buf.typed_data()[0]}, rank,
                                        int(size), int(shift), timeout_ms, &error,
                                        /*staged=*/true);
  if (!step) return ffi::Error::Internal(Prefix(kOp) + error);
  p2p::Endpoint mine;
  mine.send = send_out->untyped_data();
  mine.recv = recv->untyped_data();
  mine.bytes = send.size_bytes();
  const double rate = double(link_bytes_per_s);
  error = step->Start(rank, mine, [rate, site](Move m) {
    const double pace = m.local ? 0.0 : rate;  // a local copy is not on the link
    CopyEngine::Global().Submit(std::move(m), pace, site);
  });
  if (!error.empty()) return ffi::Error::Internal(Prefix(kOp) + error);
  Timeline::Global().Add({Timeline::kStart, site, rank, -1, int64_t(mine.bytes), begin_us,
                          Timeline::NowMicros()});
  return ffi::Error::Success();
}

ffi::Future P2pRingDone(ffi::RunId run, ffi::AnyBuffer recv, ffi::AnyBuffer send,
                        ffi::AnyBuffer after, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> recv_out,
                        ffi::Result<ffi::AnyBuffer> after_out, int64_t size, int64_t shift,
                        int64_t site) {
  constexpr const char* kOp = "flashcomm_p2p_ring_done";
  const int64_t begin_us = Timeline::NowMicros();
  const int32_t rank = rank_buf.typed_data()[0];
  if (ffi::Error e = CheckRank(kOp, rank, size, shift); e.failure()) return Failed(std::move(e));
  if (ffi::Error e = CheckRingDoneSizes(kOp, recv, send, after, *recv_out, *after_out);
      e.failure()) {
    return Failed(std::move(e));
  }
  PassThrough(after, *after_out);
  auto step = RingTable::Global().Done({run.run_id, site, group_buf.typed_data()[0]}, rank);
  if (!step) return Failed(NoRingStep(kOp, rank));
  ffi::Promise promise;
  ffi::Future future(promise);
  const RecvCopy copy = CopyRecv(recv, *recv_out);
  step->Done(rank, copy.in, [promise, copy, site, rank, begin_us](
                                const std::string& error) mutable {
    if (error.empty()) copy();
    Timeline::Global().Add({Timeline::kWait, site, rank, -1, int64_t(copy.bytes), begin_us,
                            Timeline::NowMicros()});
    CompleteLater(promise, error.empty() ? error : Prefix(kOp) + error,
                  [] { RingTable::Global().Prune(); });
  });
  return future;
}

size_t P2pRingStepsInProgress() { return RingTable::Global().InProgress(); }

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_DEFINE_CPU_RING(P2p, flashcomm::bind::Peers::kInProcess,
                          ffi::Ffi::Bind().Ctx<ffi::RunId>());
