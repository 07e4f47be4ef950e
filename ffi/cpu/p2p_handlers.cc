// The peer-to-peer transport on CPU between the virtual CPU devices of one process
// (docs/transport.md): the handlers of collective_handlers.h over the in-process rendezvous
// (p2p_rendezvous.h). Each call quantizes into its own result buffers, meets its peers and reads
// their buffers directly; the exact all-reduce (cpu_exact_sum.h) reads their x.
#include "cpu/handlers.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/collective_handlers.h"
#include "cpu/cpu_exact_sum.h"
#include "cpu/cpu_exchange.h"
#include "cpu/cpu_p2p_protocol.h"
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
              int64_t /*wire_bytes: no link emulation in one process*/,
              bool inline_then) override {
    const Published published{mine[0].data, mine[1].data, mine[2].data,
                              failed ? &p2p::kRankFailed : nullptr};
    meeting_->Arrive(barrier, rank_, published, std::move(then), inline_then);
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

// The devices of this process meet in the in-process rendezvous, keyed by (run, site, group).
struct InProcessPeers {
  static GangFactory Join(const ffi::RunId& run, int64_t site, int32_t group, int32_t rank,
                          int64_t size, int64_t timeout_ms) {
    const int64_t run_id = run.run_id;
    return [=](int barriers, uint64_t, std::string* error) -> std::unique_ptr<Gang> {
      auto meeting = Rendezvous::Global().Join({run_id, site, group}, rank, int(size), barriers,
                                               error, timeout_ms);
      if (!meeting) return nullptr;
      return std::make_unique<InProcessGang>(std::move(meeting), rank);
    };
  }
};

}  // namespace

size_t P2pMeetingsInProgress() { return Rendezvous::Global().InProgress(); }

ffi::Future P2pPsum(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                    ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                    int64_t size, int64_t site, int64_t timeout_ms, int32_t two_shot,
                    int64_t two_shot_bytes) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ExactAllReduceProtocol(
      "flashcomm_p2p_psum",
      InProcessPeers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms), rank, x,
      *y, size, timeout_ms, two_shot,
      TwoShotBySize(two_shot, two_shot_bytes, int64_t(x.size_bytes())), true);
}

ffi::Future P2pExchange(ffi::RunId run, ffi::AnyBuffer operand, ffi::AnyBuffer output,
                        ffi::Buffer<ffi::S32> input_offsets, ffi::Buffer<ffi::S32> send_sizes,
                        ffi::Buffer<ffi::S32> output_offsets, ffi::Buffer<ffi::S32> recv_sizes,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> out, int64_t size, int64_t site,
                        int64_t timeout_ms) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ExchangeProtocol(
      "flashcomm_p2p_exchange",
      InProcessPeers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms), rank,
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *out, size,
      timeout_ms);
}

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_DEFINE_CPU_COLLECTIVES(P2p, flashcomm::bind::Peers::kInProcess,
                                 flashcomm::cpu::InProcessPeers);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommP2pPsumCpu,
                              flashcomm::cpu::Guard<&flashcomm::cpu::P2pPsum>::Call,
                              flashcomm::bind::Psum<flashcomm::bind::Peers::kInProcess>(
                                  ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommP2pExchangeCpu,
                              flashcomm::cpu::Guard<&flashcomm::cpu::P2pExchange>::Call,
                              flashcomm::bind::Exchange<flashcomm::bind::Peers::kInProcess>(
                                  ffi::Ffi::Bind().Ctx<ffi::RunId>()));
