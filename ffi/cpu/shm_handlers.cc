// The peer-to-peer transport on CPU between processes on one host, one device each
// (docs/transport.md, "Across processes"): the handlers of collective_handlers.h over the
// shared-memory meeting point (shm_rendezvous.h), and the exact all-reduce (one-shot or
// two-shot) over it. Published regions are copied into shared segments that the peers map; the
// codec work is the in-process transport's, so the bits are the `xla` transport's.
#include "cpu/handlers.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/collective_handlers.h"
#include "cpu/cpu_exact_sum.h"
#include "cpu/cpu_exchange.h"
#include "cpu/cpu_p2p_protocol.h"
#include "cpu/shm_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

class ShmGang : public Gang {
 public:
  explicit ShmGang(std::shared_ptr<shm::Meeting> meeting) : meeting_(std::move(meeting)) {}
  void Arrive(int barrier, const Spans& mine, bool failed, p2p::Continuation then,
              int64_t wire_bytes, bool /*inline_then: the engine's threads run them*/) override {
    shm::Arrive(meeting_, barrier, mine, failed, std::move(then), wire_bytes);
  }
  void Abort(const std::string& why) override { shm::Abort(meeting_, why); }
  void Leave() override {
    if (meeting_) shm::Leave(meeting_);
    meeting_ = nullptr;
  }

 private:
  std::shared_ptr<shm::Meeting> meeting_;
};

// Processes of one host meet at the shared-memory meeting point, keyed by (axes, site, group)
// (the run ids of different processes differ).
struct SharedPeers {
  static GangFactory Join(const ffi::RunId&, int64_t site, int32_t group, int32_t rank,
                          int64_t size, int64_t timeout_ms, int64_t axes_key) {
    return [=](int barriers, uint64_t descriptor, std::string* error) -> std::unique_ptr<Gang> {
      auto meeting = shm::Join({axes_key, site, group, rank, int(size), barriers, descriptor,
                                timeout_ms},
                               error);
      if (!meeting) return nullptr;
      return std::make_unique<ShmGang>(std::move(meeting));
    };
  }
};

// Over an emulated link with more than two ranks the exact all-reduce always takes two shots
// (one shot sends N - 1 copies of x per rank, two shots 2 (N - 1) / N, a ring's bytes).
bool TwoShot(int32_t two_shot, int64_t two_shot_bytes, int64_t bytes, int64_t size) {
  if (two_shot != 2) return two_shot == 1;
  return TwoShotBySize(two_shot, two_shot_bytes, bytes) || (shm::LinkRate() > 0 && size > 2);
}

}  // namespace

ffi::Future ShmPsum(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                    ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                    int64_t size, int64_t site, int64_t timeout_ms, int64_t axes_key,
                    int32_t two_shot, int64_t two_shot_bytes) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ExactAllReduceProtocol(
      "flashcomm_shm_psum",
      SharedPeers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms, axes_key),
      rank, x, *y, size, timeout_ms, two_shot,
      TwoShot(two_shot, two_shot_bytes, int64_t(x.size_bytes()), size), false);
}

ffi::Future ShmExchange(ffi::RunId run, ffi::AnyBuffer operand, ffi::AnyBuffer output,
                        ffi::Buffer<ffi::S32> input_offsets, ffi::Buffer<ffi::S32> send_sizes,
                        ffi::Buffer<ffi::S32> output_offsets, ffi::Buffer<ffi::S32> recv_sizes,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> out, int64_t size, int64_t site,
                        int64_t timeout_ms, int64_t axes_key) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ExchangeProtocol(
      "flashcomm_shm_exchange",
      SharedPeers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms, axes_key),
      rank, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *out, size,
      timeout_ms);
}

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_DEFINE_CPU_COLLECTIVES(Shm, flashcomm::bind::Peers::kShared, flashcomm::cpu::SharedPeers,
                                 int64_t);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommShmPsumCpu,
                              flashcomm::cpu::Guard<&flashcomm::cpu::ShmPsum>::Call,
                              flashcomm::bind::Psum<flashcomm::bind::Peers::kShared>(
                                  ffi::Ffi::Bind().Ctx<ffi::RunId>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommShmExchangeCpu,
                              flashcomm::cpu::Guard<&flashcomm::cpu::ShmExchange>::Call,
                              flashcomm::bind::Exchange<flashcomm::bind::Peers::kShared>(
                                  ffi::Ffi::Bind().Ctx<ffi::RunId>()));
