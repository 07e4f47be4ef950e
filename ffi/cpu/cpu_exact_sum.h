// The exact all-reduce on CPU (docs/transport.md, "The exact all-reduce"): every rank's x summed
// in rank order (16-bit floats in f32, rounded once to their dtype), so every rank gets the same
// bits. One shot: every rank reads every peer's x and sums all of it. Two shots: rank r sums
// chunk r of every rank's x into its own y, then every rank copies the other chunks from their
// owners' y.
// Written once over a Gang: the devices of one process (p2p_handlers.cc) and processes of one
// host over shared memory (shm_handlers.cc) run it alike. The sums themselves are the
// instruction-set builds' (cpu_sum_lanes.h, through cpu_dispatch.h's table).
#ifndef FLASHCOMM_CPU_EXACT_SUM_H_
#define FLASHCOMM_CPU_EXACT_SUM_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// The element types the exact all-reduce sums, and how many components of a summed type one
// element is (complex: 2); 0 for a type it does not take.
inline int SumComponents(ffi::DataType type) {
  switch (type) {
    case ffi::F32: case ffi::BF16: case ffi::F16: case ffi::F64:
    case ffi::S8: case ffi::S16: case ffi::S32: case ffi::S64:
    case ffi::U8: case ffi::U16: case ffi::U32: case ffi::U64:
      return 1;
    case ffi::C64: case ffi::C128:
      return 2;
    default:
      return 0;
  }
}

// What `type` is summed as (SumType; complex: its components). SumComponents(type) > 0.
inline SumType SumTypeOf(ffi::DataType type) {
  switch (type) {
    case ffi::F32: case ffi::C64: return SumType::kF32;
    case ffi::BF16: return SumType::kBF16;
    case ffi::F16: return SumType::kF16;
    case ffi::F64: case ffi::C128: return SumType::kF64;
    case ffi::S8: case ffi::U8: return SumType::kU8;
    case ffi::S16: case ffi::U16: return SumType::kU16;
    case ffi::S32: case ffi::U32: return SumType::kU32;
    default: return SumType::kU64;  // S64, U64
  }
}

// Elements [begin, end) of every rank's x summed in rank order (16-bit floats in f32, rounded
// once) into each of `ys` (which may be the xs), for any type SumComponents takes, by the
// instruction-set build in use (cpu_dispatch.h).
inline void SumRanks(ffi::DataType type, const std::vector<const void*>& xs, int64_t begin,
                     int64_t end, const std::vector<void*>& ys) {
  const int64_t components = SumComponents(type);
  kernels().sum_ranks(SumTypeOf(type), xs.data(), int64_t(xs.size()), components * begin,
                      components * end, ys.data(), int64_t(ys.size()));
}

// The values of one piece of the in-process two-shot sum (ExactAllReduceProtocol).
constexpr int64_t kPieceBytes = 16 * 1024;

// The in-process two-shot sum's shared state, rank 0's (published at barrier 0). Every rank's
// barrier-0 continuation runs in the thread that opened the barrier (Gang::Arrive's inline_then)
// and only registers its call; the last to run starts the sum: it offers the other ranks'
// handler threads, which await their calls (Call::AwaitInHandler), a share of the work, and sums
// pieces itself, each piece taken from one counter by whichever thread asks next. Whoever sums
// the last piece passes barrier 1 for every rank, so no thread waits for another's work, and a
// thread that comes late finds no piece and touches nothing else.
class PushSum : public std::enable_shared_from_this<PushSum> {
 public:
  PushSum(ffi::DataType dtype, int64_t count, int64_t per_piece, int64_t size)
      : dtype_(dtype), count_(count), per_piece_(per_piece),
        pieces_((count + per_piece - 1) / per_piece), left_(pieces_ + 1), calls_(size) {}

  // Rank `rank`'s barrier-0 continuation (`peers`: every rank's x, y and rank 0's state);
  // `share`: offer the others a share. Never throws: a failed allocation fails this rank's call
  // (its peers learn of it at barrier 1) and the pieces nobody took are dropped.
  void Join(int32_t rank, std::shared_ptr<Call> call, const std::vector<Published>& peers,
            bool share) noexcept {
    calls_[rank] = std::move(call);
    if (joined_.fetch_add(1, std::memory_order_acq_rel) + 1 < int64_t(calls_.size())) return;
    try {
      std::vector<const void*> xs(peers.size());
      std::vector<void*> ys(peers.size());
      for (size_t j = 0; j < peers.size(); ++j) {
        xs[j] = peers[j][0];
        ys[j] = const_cast<void*>(peers[j][1]);
      }
      // every other rank's thread (one per piece at most): each is woken at the end anyway, and
      // one that is awake then sees the end sooner (more offers measured faster, not slower)
      int64_t offers = share ? std::min<int64_t>(pieces_, int64_t(calls_.size())) - 1 : 0;
      for (size_t r = 0; r < calls_.size() && offers > 0; ++r) {
        if (int32_t(r) == rank) continue;
        offers -= calls_[r]->Offer([self = shared_from_this(), xs, ys] { self->Sum(xs, ys); });
      }
      Sum(xs, ys);
    } catch (const std::exception& e) {
      calls_[rank]->Fail(ffi::ErrorCode::kInternal, e.what());
      int64_t dropped = 0;
      while (next_.fetch_add(1) < pieces_) ++dropped;
      if (dropped > 0) Done(dropped);
    }
    Done(1);
  }

 private:
  void Sum(const std::vector<const void*>& xs, const std::vector<void*>& ys) noexcept {
    int64_t summed = 0;
    for (int64_t k = next_.fetch_add(1); k < pieces_; k = next_.fetch_add(1), ++summed) {
      SumRanks(dtype_, xs, k * per_piece_, std::min(count_, (k + 1) * per_piece_), ys);
    }
    if (summed > 0) Done(summed);
  }
  // `n` more pieces summed (or the start done); the one that ends the count passes barrier 1
  // for every rank (the last barrier: its last arrival finishes every call, here).
  void Done(int64_t n) noexcept {
    if (left_.fetch_sub(n, std::memory_order_acq_rel) != n) return;
    const std::vector<std::shared_ptr<Call>> calls = std::move(calls_);
    for (const auto& call : calls) {
      try {
        call->Arrive(1, Spans{}, [call](const std::vector<Published>&) { call->Finish(); });
      } catch (const std::exception& e) {
        call->Abort(e.what());  // fails the meeting: the other ranks' calls end with the error
      }
    }
  }
  const ffi::DataType dtype_;
  const int64_t count_, per_piece_, pieces_;
  std::atomic<int64_t> next_{0}, left_, joined_{0};
  std::vector<std::shared_ptr<Call>> calls_;
};

// The other ranks' threads are offered a share of an in-process two-shot sum once it reads
// this many bytes of x (every rank's).
constexpr int64_t kSharedSumBytes = 128 * 1024;

// How long a handler of the in-process two-shot sum of `bytes` of x (every rank's) waits for
// its call before it returns the future open (Call::AwaitInHandler; every handler waits: in
// SmolLM2's decode step on an AMD EPYC Zen 4, timed token by token against lax.psum's, the
// step took 0.95x lax's with waiting handlers, 1.08x with handlers that returned at once below
// 64 KiB of x in all): 2 ms, and the time to read
// those bytes at 4 GB/s (peers in step come within it; a wait for peers that reach collectives
// in another order costs no more than that).
inline std::chrono::microseconds AwaitInHandlerLimit(int64_t bytes) {
  return std::chrono::microseconds(2000 + bytes / 4000);
}

// two_shot: 0 one shot, 1 two shots, 2 two shots from two_shot_bytes of x per rank
// (jax_flashcomm.transport.p2p.TWO_SHOT_BYTES).
inline bool TwoShotBySize(int32_t two_shot, int64_t two_shot_bytes, int64_t bytes) {
  return two_shot == 2 ? bytes >= two_shot_bytes : two_shot == 1;
}

// The exact all-reduce of this rank's x into y among the gang `join` makes (`op` names the
// target in errors). Completes the future once every peer is done with this rank's buffers.
// `one_space`: the ranks share this address space (devices of one process), so the two-shot
// sums go straight into every rank's y, piece by piece, by whichever rank takes the piece (two
// barriers, no second read; y may be x: jax_flashcomm.transport.p2p aliases them); else
// (processes) rank r sums chunk r and every rank copies the other chunks from their owners'
// published sums.
inline ffi::Future ExactAllReduceProtocol(const char* op, const GangFactory& join, int32_t rank,
                                          const ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                                          int64_t size, int64_t timeout_ms, int32_t two_shot_mode,
                                          bool two_shot, bool one_space) {
  // long function: the checks and the one- and two-shot protocols, barrier by barrier
  if (size < 1 || rank < 0 || rank >= size) {
    return Failed(ffi::Error::InvalidArgument(std::string(op) + ": rank " +
                                              std::to_string(rank) + " is not in 0.." +
                                              std::to_string(size - 1)));
  }
  if (timeout_ms <= 0) {
    return Failed(ffi::Error::InvalidArgument(std::string(op) + ": timeout_ms must be positive"));
  }
  if (two_shot_mode < 0 || two_shot_mode > 2) {
    return Failed(ffi::Error::InvalidArgument(std::string(op) + ": two_shot must be 0, 1 or 2"));
  }
  const ffi::DataType dtype = x.element_type();
  if (SumComponents(dtype) == 0) {
    return Failed(ffi::Error::InvalidArgument(
        std::string(op) + ": x must be a float (f32, bf16, f16, f64), complex or integer array"));
  }
  if (y.element_count() != x.element_count() || y.element_type() != x.element_type()) {
    return Failed(ffi::Error::InvalidArgument(std::string(op) + ": y must be x's shape"));
  }
  const bool push = two_shot && one_space;
  if (y.untyped_data() == x.untyped_data() && !push && x.size_bytes() > 0) {
    return Failed(ffi::Error::InvalidArgument(
        std::string(op) + ": y aliases x, and only the two-shot sum of one address space "
        "runs in place"));
  }
  const int64_t count = int64_t(x.element_count());
  const size_t item = x.size_bytes() / std::max<size_t>(x.element_count(), 1);
  std::string error;
  auto call = Call::Join(op, rank, join, two_shot && !push ? 3 : 2,
                         Describe({4, int64_t(x.element_type()), count, size, two_shot}), &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(op) + ": " + error));
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
      if (!call->failed()) SumRanks(dtype, inputs(peers), 0, count, {out});
      call->Arrive(1, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
    }, (size - 1) * bytes);
    return done;
  }
  auto bound = [count, size](int64_t j) { return count * j / size; };
  if (push) {
    const int64_t per_piece = std::max<int64_t>(1, kPieceBytes / int64_t(item));
    std::shared_ptr<PushSum> sum;
    if (rank == 0) {
      sum = std::make_shared<PushSum>(dtype, count, per_piece, size);
    }
    const Spans published{mine[0], Span{out, y.size_bytes()}, Span{sum.get(), 0}, Span{}};
    const bool share = size * bytes >= kSharedSumBytes;
    call->ExpectAwait();
    call->Arrive(0, published, [=](const std::vector<Published>& peers) {
      (void)sum;
      static_cast<PushSum*>(const_cast<void*>(peers[0][2]))->Join(rank, call, peers, share);
    }, 0, /*inline_next=*/true);
    call->AwaitInHandler(AwaitInHandlerLimit(size * bytes));
    return done;
  }
  call->Arrive(0, mine, [=](const std::vector<Published>& peers) {
    const int64_t lo = bound(rank), hi = bound(rank + 1);
    if (!call->failed()) SumRanks(dtype, inputs(peers), lo, hi, {out});
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

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_EXACT_SUM_H_
