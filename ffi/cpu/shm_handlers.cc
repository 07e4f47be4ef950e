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
              int64_t wire_bytes) override {
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

// y[i] = every rank's x[i] summed in f32 in rank order, rounded once to the dtype, for i in
// [begin, end) (XLA:CPU's psum of bf16 / f16 sums in f32 too).
void SumRanks(DType dtype, const std::vector<const void*>& xs, int64_t begin, int64_t end,
              void* y) {
  const size_t n = xs.size();
  if (dtype == DType::kF32) {
    auto* out = static_cast<float*>(y);
    const auto* x0 = static_cast<const float*>(xs[0]);
    for (int64_t i = begin; i < end; ++i) out[i] = x0[i];
    for (size_t j = 1; j < n; ++j) {
      const auto* xj = static_cast<const float*>(xs[j]);
      for (int64_t i = begin; i < end; ++i) out[i] += xj[i];
    }
    return;
  }
  constexpr int64_t kBlock = 2048;  // f32 partial sums of one block, kept in cache
  float acc[kBlock];
  auto* out = static_cast<uint16_t*>(y);
  const bool bf16 = dtype == DType::kBF16;
  for (int64_t lo = begin; lo < end; lo += kBlock) {
    const int64_t len = std::min(kBlock, end - lo);
    for (size_t j = 0; j < n; ++j) {
      const auto* xj = static_cast<const uint16_t*>(xs[j]) + lo;
      if (bf16) {
        for (int64_t i = 0; i < len; ++i) {
          const float v = bf16_to_float(xj[i]);
          acc[i] = j == 0 ? v : acc[i] + v;
        }
      } else {
        for (int64_t i = 0; i < len; ++i) {
          const float v = f16_to_float(xj[i]);
          acc[i] = j == 0 ? v : acc[i] + v;
        }
      }
    }
    for (int64_t i = 0; i < len; ++i) {
      out[lo + i] = bf16 ? bf16_from_float(acc[i]) : f16_from_float(acc[i]);
    }
  }
}

// two_shot: 0 one shot, 1 two shots, 2 by size and link: two shots from two_shot_bytes per rank
// (jax_flashcomm.transport.p2p.TWO_SHOT_BYTES), and always over an emulated link with more
// than two ranks (one shot sends N - 1 copies of x per rank, two shots 2 (N - 1) / N, a ring's
// bytes).
bool TwoShot(int32_t two_shot, int64_t two_shot_bytes, int64_t bytes, int64_t size) {
  if (two_shot != 2) return two_shot == 1;
  return bytes >= two_shot_bytes || (shm::LinkRate() > 0 && size > 2);
}

ffi::Future ExactAllReduceProtocol(const GangFactory& join, int32_t rank,
                                   const ffi::AnyBuffer& x, ffi::AnyBuffer& y, int64_t size,
                                   int64_t timeout_ms, bool two_shot) {
  constexpr const char* kOp = "flashcomm_shm_psum";
  if (size < 1 || rank < 0 || rank >= size) {
    return Failed(ffi::Error::InvalidArgument(std::string(kOp) + ": rank " +
                                              std::to_string(rank) + " is not in 0.." +
                                              std::to_string(size - 1)));
  }
  if (timeout_ms <= 0) {
    return Failed(ffi::Error::InvalidArgument(std::string(kOp) + ": timeout_ms must be positive"));
  }
  DType dtype = DType::kF32;
  if (!ToDType(x.element_type(), &dtype)) {
    return Failed(ffi::Error::InvalidArgument(std::string(kOp) + ": x must be f32, bf16 or f16"));
  }
  if (y.element_count() != x.element_count() || y.element_type() != x.element_type()) {
    return Failed(ffi::Error::InvalidArgument(std::string(kOp) + ": y must be x's shape"));
  }
  const int64_t count = int64_t(x.element_count());
  const size_t item = x.size_bytes() / std::max<size_t>(x.element_count(), 1);
  std::string error;
  auto call = Call::Join(kOp, rank, join, two_shot ? 3 : 2,
                         Describe({4, int64_t(x.element_type()), count, size, two_shot}), &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(kOp) + ": " + error));
  ffi::Future done = call->future();
  auto* out = static_cast<uint8_t*>(y.untyped_data());
  const Spans mine{Span{x.untyped_data(), x.size_bytes()}, Span{}, Span{}, Span{}};
  auto inputs = [size](const std::vector<Published>& peers) {
    std::vector<const void*> xs(size);
    for (int64_t j = 0; j < size; ++j) xs[j] = peers[j][0];
    return xs;
  };
  const int64_t bytes = int64_t(x.size_bytes());
  if (!two_shot) {  // every peer reads all of x
    call->Arrive(0, mine, [=](const std::vector<Published>& peers) {
      if (!call->failed()) SumRanks(dtype, inputs(peers), 0, count, out);
      call->Arrive(1, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
    }, (size - 1) * bytes);
    return done;
  }
  // Two-shot: rank r sums chunk r of every rank's x; then every rank copies every chunk.
  auto bound = [count, size](int64_t j) { return count * j / size; };
  call->Arrive(0, mine, [=](const std::vector<Published>& peers) {
    const int64_t lo = bound(rank), hi = bound(rank + 1);
    if (!call->failed()) SumRanks(dtype, inputs(peers), lo, hi, out);
    const Spans chunk{Span{out + lo * item, size_t(hi - lo) * item}, Span{}, Span{}, Span{}};
    call->Arrive(1, chunk, [=](const std::vector<Published>& peers) {
      for (int64_t j = 0; j < size && !call->failed(); ++j) {
        if (j == rank || bound(j + 1) == bound(j)) continue;
        std::memcpy(out + bound(j) * item, peers[j][0], size_t(bound(j + 1) - bound(j)) * item);
      }
      call->Arrive(2, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
    }, (size - 1) * (hi - lo) * int64_t(item));  // every peer reads this rank's chunk
  }, bytes - (bound(rank + 1) - bound(rank)) * int64_t(item));  // each peer its chunk of x
  return done;
}

}  // namespace

ffi::Future ShmPsum(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                    ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                    int64_t size, int64_t site, int64_t timeout_ms, int64_t axes_key,
                    int32_t two_shot, int64_t two_shot_bytes) {
  const int32_t rank = rank_buf.typed_data()[0];
  return ExactAllReduceProtocol(
      SharedPeers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms, axes_key),
      rank, x, *y, size, timeout_ms, TwoShot(two_shot, two_shot_bytes, int64_t(x.size_bytes()), size));
}

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_DEFINE_CPU_COLLECTIVES(Shm, flashcomm::bind::Peers::kShared, flashcomm::cpu::SharedPeers,
                                 int64_t);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommShmPsumCpu,
                              flashcomm::cpu::Guard<&flashcomm::cpu::ShmPsum>::Call,
                              flashcomm::bind::Psum(ffi::Ffi::Bind().Ctx<ffi::RunId>()));
