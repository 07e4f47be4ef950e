// The exact all-reduce on CPU (docs/transport.md, "The exact all-reduce"): every rank's x summed
// in rank order (16-bit floats in f32, rounded once to their dtype), so every rank gets the same
// bits. One shot: every rank reads every peer's x and sums all of it. Two shots: rank r sums
// chunk r of every rank's x into its own y, then every rank copies the other chunks from their
// owners' y.
// Written once over a Gang: the devices of one process (p2p_handlers.cc) and processes of one
// host over shared memory (shm_handlers.cc) run it alike.
#ifndef FLASHCOMM_CPU_EXACT_SUM_H_
#define FLASHCOMM_CPU_EXACT_SUM_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/codec.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// Values [begin, end) of every rank's x (xs, rank order) summed into each of `ys`: per block
// of kBlock values, acc = load(x_0), then acc = acc + load(x_j) for j = 1..N-1 in order, and
// store(acc) written to every y. T: the stored type; A: the accumulator (f32 for the 16-bit
// floats; for integers T itself, wrapping as XLA's do: unsigned arithmetic, two's complement).
template <typename T, typename A, typename Load, typename Store>
void SumBlocks(const std::vector<const void*>& xs, int64_t begin, int64_t end,
               const std::vector<void*>& ys, Load load, Store store) {
  constexpr int64_t kBlock = 2048;  // the partial sums of one block, kept in L1
  A acc[kBlock];
  for (int64_t lo = begin; lo < end; lo += kBlock) {
    const int64_t len = std::min(kBlock, end - lo);
    const T* x0 = static_cast<const T*>(xs[0]) + lo;
    for (int64_t i = 0; i < len; ++i) acc[i] = load(x0[i]);
    for (size_t j = 1; j < xs.size(); ++j) {
      const T* xj = static_cast<const T*>(xs[j]) + lo;
      for (int64_t i = 0; i < len; ++i) acc[i] = A(acc[i] + load(xj[i]));
    }
    T* first = static_cast<T*>(ys[0]) + lo;
    for (int64_t i = 0; i < len; ++i) first[i] = store(acc[i]);
  }
  // the other copies in one pass each (a long memcpy streams faster than many short ones)
  for (size_t k = 1; k < ys.size(); ++k) {
    std::memcpy(static_cast<T*>(ys[k]) + begin, static_cast<const T*>(ys[0]) + begin,
                size_t(end - begin) * sizeof(T));
  }
}

template <typename T>
void SumNative(const std::vector<const void*>& xs, int64_t begin, int64_t end,
               const std::vector<void*>& ys) {
  SumBlocks<T, T>(xs, begin, end, ys, [](T v) { return v; }, [](T v) { return v; });
}

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

// Elements [begin, end) of every rank's x summed in rank order (16-bit floats in f32, rounded
// once) into each of `ys`, for any type SumComponents takes.
inline void SumRanks(ffi::DataType type, const std::vector<const void*>& xs, int64_t begin,
                     int64_t end, const std::vector<void*>& ys) {
  switch (type) {
    case ffi::F32: return SumNative<float>(xs, begin, end, ys);
    case ffi::BF16:
      return SumBlocks<uint16_t, float>(
          xs, begin, end, ys, [](uint16_t v) { return bf16_to_float(v); },
          [](float v) { return bf16_from_float(v); });
    case ffi::F16:
      return SumBlocks<uint16_t, float>(
          xs, begin, end, ys, [](uint16_t v) { return f16_to_float(v); },
          [](float v) { return f16_from_float(v); });
    case ffi::F64: return SumNative<double>(xs, begin, end, ys);
    case ffi::C64: return SumNative<float>(xs, 2 * begin, 2 * end, ys);
    case ffi::C128: return SumNative<double>(xs, 2 * begin, 2 * end, ys);
    case ffi::S8: case ffi::U8: return SumNative<uint8_t>(xs, begin, end, ys);
    case ffi::S16: case ffi::U16: return SumNative<uint16_t>(xs, begin, end, ys);
    case ffi::S32: case ffi::U32: return SumNative<uint32_t>(xs, begin, end, ys);
    default: return SumNative<uint64_t>(xs, begin, end, ys);  // S64, U64
  }
}

// The values of one piece of the in-process two-shot sum (ExactAllReduceProtocol).
constexpr int64_t kPieceBytes = 16 * 1024;

// two_shot: 0 one shot, 1 two shots, 2 two shots from two_shot_bytes of x per rank
// (jax_flashcomm.transport.p2p.TWO_SHOT_BYTES).
inline bool TwoShotBySize(int32_t two_shot, int64_t two_shot_bytes, int64_t bytes) {
  return two_shot == 2 ? bytes >= two_shot_bytes : two_shot == 1;
}

// The exact all-reduce of this rank's x into y among the gang `join` makes (`op` names the
// target in errors). Completes the future once every peer is done with this rank's buffers.
// `one_space`: the ranks share this address space (devices of one process), so the two-shot
// sums go straight into every rank's y, piece by piece, by whichever rank takes the piece (two
// barriers, no second read); else (processes) rank r sums chunk r and every rank copies the
// other chunks from their owners' published sums.
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
  const int64_t count = int64_t(x.element_count());
  const size_t item = x.size_bytes() / std::max<size_t>(x.element_count(), 1);
  std::string error;
  const bool push = two_shot && one_space;
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
    // The values in pieces of kPieceBytes, handed out by rank 0's counter to whichever rank's
    // continuation asks next (the last rank to arrive starts at once; the others join as their
    // threads wake): each piece of every x summed into every rank's y. The order of each sum is
    // rank order whoever computes it, so the bits do not depend on who did which piece.
    auto counter = std::make_shared<std::atomic<int64_t>>(0);
    const Spans published{mine[0], Span{out, y.size_bytes()}, Span{counter.get(), 0}, Span{}};
    const int64_t per_piece = std::max<int64_t>(1, kPieceBytes / int64_t(item));
    const int64_t pieces = (count + per_piece - 1) / per_piece;
    call->Arrive(0, published, [=](const std::vector<Published>& peers) {
      std::vector<void*> ys(size);
      for (int64_t j = 0; j < size; ++j) ys[j] = const_cast<void*>(peers[j][1]);
      auto* next = static_cast<std::atomic<int64_t>*>(const_cast<void*>(peers[0][2]));
      const std::vector<const void*> xs = inputs(peers);
      for (int64_t k = next->fetch_add(1); k < pieces && !call->failed(); k = next->fetch_add(1)) {
        SumRanks(dtype, xs, k * per_piece, std::min(count, (k + 1) * per_piece), ys);
      }
      // rank 0's counter lives until every rank has passed the last barrier
      call->Arrive(1, Spans{}, [call, counter](const std::vector<Published>&) { call->Finish(); });
    });
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
