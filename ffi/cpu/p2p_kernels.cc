// The peer-to-peer transport on CPU between the virtual CPU devices of one process
// (docs/transport.md): the protocols of cpu_p2p_protocol.h over the in-process rendezvous
// (p2p_rendezvous.h). Each call quantizes into its own result buffers, meets its peers and reads
// their buffers directly.
#include "flashcomm/cpu_p2p.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashcomm/cpu_p2p_protocol.h"
#include "flashcomm/p2p_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

using p2p::Rendezvous;

// The devices of this process: every rank publishes its own buffers' pointers.
class InProcessGang : public Gang {
 public:
  InProcessGang(std::shared_ptr<p2p::Meeting> meeting, int rank)
      : meeting_(std::move(meeting)), rank_(rank) {}
  void Arrive(int barrier, const Spans& mine, bool failed, p2p::Continuation then,
              int64_t /*wire_bytes: no link emulation in one process*/) override {
    const Published published{mine[0].data, mine[1].data, mine[2].data,
                              failed ? &p2p::kRankFailed : nullptr};
    meeting_->Arrive(barrier, rank_, published, std::move(then));
  }
  void Abort(const std::string& why) override { meeting_->Abort(why); }
  void Leave() override {
    if (meeting_) Rendezvous::Global().Leave(meeting_);
    meeting_ = nullptr;
  }

 private:
  std::shared_ptr<p2p::Meeting> meeting_;
  int rank_;
};

// The gang of the call (run, site, group) of `rank` among `size`.
GangFactory InProcess(const ffi::RunId& run, int64_t site, int32_t group, int32_t rank,
                      int64_t size, int64_t timeout_ms) {
  const int64_t run_id = run.run_id;
  return [=](int barriers, uint64_t, std::string* error) -> std::unique_ptr<Gang> {
    auto meeting = Rendezvous::Global().Join({run_id, site, group}, rank, int(size), barriers,
                                             error, timeout_ms);
    if (!meeting) return nullptr;
    return std::make_unique<InProcessGang>(std::move(meeting), rank);
  };
}

}  // namespace

ffi::Future P2pAllReduce(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                         ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                         ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                         ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero,
                         ffi::Result<ffi::Buffer<ffi::U8>> p2_codes,
                         ffi::Result<ffi::Buffer<ffi::BF16>> p2_scale,
                         ffi::Result<ffi::Buffer<ffi::BF16>> p2_zero, int32_t bits,
                         int32_t out_bits, int64_t group_size, int32_t rotation, int32_t spikes,
                         int32_t out_spikes, int64_t size, int64_t site, int64_t timeout_ms) {
  const int32_t rank = rank_buf.typed_data()[0];
  return AllReduceProtocol(InProcess(run, site, group_buf.typed_data()[0], rank, size, timeout_ms),
                           rank, x, *y, *p1_codes, *p1_scale, *p1_zero, *p2_codes, *p2_scale,
                           *p2_zero, bits, out_bits, group_size, rotation, spikes, out_spikes,
                           size, timeout_ms);
}

ffi::Future P2pReduceScatter(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::Buffer<ffi::U8>> codes,
                             ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                             ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                             int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                             int64_t site, int64_t timeout_ms) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ReduceScatterProtocol(
      InProcess(run, site, group_buf.typed_data()[0], rank, size, timeout_ms), rank, x, *y,
      *codes, *scale, *zero, bits, group_size, rotation, spikes, size, timeout_ms);
}

ffi::Future P2pAllGather(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                         ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::U8>> codes,
                         ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                         ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                         int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                         int64_t site, int64_t timeout_ms) {
  const int32_t rank = rank_buf.typed_data()[0];
  return AllGatherProtocol(InProcess(run, site, group_buf.typed_data()[0], rank, size, timeout_ms),
                           rank, x, *y, *codes, *scale, *zero, bits, group_size, rotation, spikes,
                           size, timeout_ms);
}

size_t P2pMeetingsInProgress() { return Rendezvous::Global().InProgress(); }

}  // namespace cpu
}  // namespace flashcomm

// Shared by the three handlers: the rank (lax.axis_index over the reduced axes, lax's tuple
// order) and replica group (index over the mesh axes not reduced) as int32 scalar operands.
#define FLASHCOMM_P2P_COMMON_ATTRS                                                         \
  .Attr<int64_t>("size")          /* ranks in the replica group */                         \
      .Attr<int64_t>("site")      /* the call site: peers of one call share it */          \
      .Attr<int64_t>("timeout_ms") /* every wait gives up after this, with an error */

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pAllReduceCpu, flashcomm::cpu::Guard<&flashcomm::cpu::P2pAllReduce>::Call,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()                 // the execution: peers of one run meet
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: x's shape and dtype, the decoded sum (or empty)
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-1 codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 zero
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-2 codes, gathered: (N * gpc, bytes')
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 scale: (N * gpc)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 zero
        .Attr<int32_t>("bits")             // phase-1 code width, 2..8
        .Attr<int32_t>("out_bits")         // phase-2 code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2 (both phases)
        .Attr<int32_t>("spikes")           // phase-1 spikes per group, 0..16
        .Attr<int32_t>("out_spikes")       // phase-2 spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pReduceScatterCpu, flashcomm::cpu::Guard<&flashcomm::cpu::P2pReduceScatter>::Call,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()                 // the execution: peers of one run meet
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (groups_per_chunk, group_size), chunk `rank`
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pAllGatherCpu, flashcomm::cpu::Guard<&flashcomm::cpu::P2pAllGather>::Call,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()                 // the execution: peers of one run meet
        .Arg<ffi::AnyBuffer>()             // x: (groups, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (N, groups, group_size), rank j's in slot j
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (groups, bytes), this rank's payload
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (groups)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);
