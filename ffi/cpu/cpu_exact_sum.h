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
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/codec.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// 64 bytes of lanes (GCC / Clang vector extensions: every target lowers them, SSE2 to AVX-512
// and NEON, one instruction or several per operation).
typedef float F32x16 __attribute__((vector_size(64)));
typedef double F64x8 __attribute__((vector_size(64)));
typedef uint8_t U8x64 __attribute__((vector_size(64)));
typedef uint16_t U16x32 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint64_t U64x8 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

template <typename V, typename T>
inline V LoadLanes(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// The first y's values [begin, end) copied into every other y, one pass each (a long memcpy
// streams faster than many short ones).
template <typename T>
void CopyToOthers(int64_t begin, int64_t end, const std::vector<void*>& ys) {
  for (size_t k = 1; k < ys.size(); ++k) {
    std::memcpy(static_cast<T*>(ys[k]) + begin, static_cast<const T*>(ys[0]) + begin,
                size_t(end - begin) * sizeof(T));
  }
}

// Values [begin, end) of every rank's x (xs, rank order) summed into each of `ys`, element by
// element: acc = load(x_0), then acc = acc + load(x_j) for j = 1..N-1 in order, and store(acc)
// written to every y. T: the stored type; A: the accumulator (f32 for the 16-bit floats; for
// integers T itself, wrapping as XLA's do: unsigned arithmetic, two's complement). One element
// at a time: the dtypes without lanes below (f16) and the tails.
template <typename T, typename A, typename Load, typename Store>
void SumElements(const std::vector<const void*>& xs, int64_t begin, int64_t end,
                 const std::vector<void*>& ys, Load load, Store store) {
  T* first = static_cast<T*>(ys[0]);
  for (int64_t i = begin; i < end; ++i) {
    A acc = load(static_cast<const T*>(xs[0])[i]);
    for (size_t j = 1; j < xs.size(); ++j) acc = A(acc + load(static_cast<const T*>(xs[j])[i]));
    first[i] = store(acc);
  }
}

// `bytes` from `src` (16-byte aligned) to `dst` with stores that bypass the caches (x86's
// non-temporal stores; elsewhere, or unaligned, a memcpy). Followed by StreamFence before the
// values are handed on.
inline void StreamCopy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0) {
    auto* d = static_cast<__m128i*>(dst);
    const auto* s = static_cast<const __m128i*>(src);
    for (size_t q = 0; q < bytes / 16; ++q) _mm_stream_si128(d + q, _mm_load_si128(s + q));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

inline void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The same sums, a vector V of T's lanes at a time (T summed as itself: f32, f64, the unsigned
// integers), a block of kBlockBytes at a time: the block's partial sums stay in L1 while each
// rank's x streams past in turn (one read stream at a time, as the prefetchers like). The order
// of each element's sum is the scalar one, so are its bits. `stream`: write every y's block
// past the caches (StreamCopy: no read for ownership of lines that would not stay cached).
constexpr int64_t kBlockBytes = 16 * 1024;

template <typename T, typename V>
void SumNative(const std::vector<const void*>& xs, int64_t begin, int64_t end,
               const std::vector<void*>& ys, bool stream) {
  constexpr int64_t kLanes = int64_t(sizeof(V) / sizeof(T));
  constexpr int64_t kBlock = kBlockBytes / int64_t(sizeof(V));  // vectors per block
  T* first = static_cast<T*>(ys[0]);
  V acc[kBlock];
  int64_t i = begin;
  while (i + kLanes <= end) {
    const int64_t vectors = std::min<int64_t>(kBlock, (end - i) / kLanes);
    const T* x0 = static_cast<const T*>(xs[0]) + i;
    for (int64_t v = 0; v < vectors; ++v) acc[v] = LoadLanes<V>(x0 + v * kLanes);
    for (size_t j = 1; j < xs.size(); ++j) {
      const T* xj = static_cast<const T*>(xs[j]) + i;
      for (int64_t v = 0; v < vectors; ++v) acc[v] += LoadLanes<V>(xj + v * kLanes);
    }
    const size_t block = size_t(vectors) * sizeof(V);
    for (size_t k = 0; stream && k < ys.size(); ++k) StreamCopy(static_cast<T*>(ys[k]) + i, acc, block);
    if (!stream) std::memcpy(first + i, acc, block);
    i += vectors * kLanes;
  }
  SumElements<T, T>(xs, i, end, ys, [](T v) { return v; }, [](T v) { return v; });
  if (stream) StreamFence();
  CopyToOthers<T>(stream ? i : begin, end, ys);
}

// bf16 summed in f32, 16 lanes at a time, rounded once (bf16_from_float's rounding, lane by
// lane: nearest even, NaN kept quiet).
inline void SumBf16(const std::vector<const void*>& xs, int64_t begin, int64_t end,
                    const std::vector<void*>& ys) {
  constexpr int64_t kLanes = 16;
  auto widen = [](const uint16_t* p) {
    return F32x16(__builtin_convertvector(LoadLanes<U16x16>(p), U32x16) << 16);
  };
  uint16_t* first = static_cast<uint16_t*>(ys[0]);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    F32x16 acc = widen(static_cast<const uint16_t*>(xs[0]) + i);
    for (size_t j = 1; j < xs.size(); ++j) acc += widen(static_cast<const uint16_t*>(xs[j]) + i);
    const U32x16 u = U32x16(acc);
    const U32x16 nearest = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const U32x16 quiet = (u >> 16) | 0x0040u;
    const U32x16 bits = ((u & 0x7FFFFFFFu) > 0x7F800000u) ? quiet : nearest;
    const U16x16 out = __builtin_convertvector(bits, U16x16);
    std::memcpy(first + i, &out, sizeof(out));
  }
  SumElements<uint16_t, float>(
      xs, i, end, ys, [](uint16_t v) { return bf16_to_float(v); },
      [](float v) { return bf16_from_float(v); });
  CopyToOthers<uint16_t>(begin, end, ys);
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
// once) into each of `ys`, for any type SumComponents takes (`stream`: SumNative's, where it
// applies).
inline void SumRanks(ffi::DataType type, const std::vector<const void*>& xs, int64_t begin,
                     int64_t end, const std::vector<void*>& ys, bool stream = false) {
  switch (type) {
    case ffi::F32: return SumNative<float, F32x16>(xs, begin, end, ys, stream);
    case ffi::BF16: return SumBf16(xs, begin, end, ys);
    case ffi::F16:
      SumElements<uint16_t, float>(
          xs, begin, end, ys, [](uint16_t v) { return f16_to_float(v); },
          [](float v) { return f16_from_float(v); });
      return CopyToOthers<uint16_t>(begin, end, ys);
    case ffi::F64: return SumNative<double, F64x8>(xs, begin, end, ys, stream);
    case ffi::C64: return SumNative<float, F32x16>(xs, 2 * begin, 2 * end, ys, stream);
    case ffi::C128: return SumNative<double, F64x8>(xs, 2 * begin, 2 * end, ys, stream);
    case ffi::S8: case ffi::U8: return SumNative<uint8_t, U8x64>(xs, begin, end, ys, stream);
    case ffi::S16: case ffi::U16: return SumNative<uint16_t, U16x32>(xs, begin, end, ys, stream);
    case ffi::S32: case ffi::U32: return SumNative<uint32_t, U32x16>(xs, begin, end, ys, stream);
    default: return SumNative<uint64_t, U64x8>(xs, begin, end, ys, stream);  // S64, U64
  }
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
  // `stream`: write the sums past the caches (SumNative).
  PushSum(ffi::DataType dtype, int64_t count, int64_t per_piece, int64_t size, bool stream)
      : dtype_(dtype), stream_(stream), count_(count), per_piece_(per_piece),
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
      SumRanks(dtype_, xs, k * per_piece_, std::min(count_, (k + 1) * per_piece_), ys, stream_);
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
  const bool stream_;
  const int64_t count_, per_piece_, pieces_;
  std::atomic<int64_t> next_{0}, left_, joined_{0};
  std::vector<std::shared_ptr<Call>> calls_;
};

// The other ranks' threads are offered a share of an in-process two-shot sum once it reads
// this many bytes of x (every rank's).
constexpr int64_t kSharedSumBytes = 128 * 1024;

// An in-process two-shot sum of this many bytes of x (every rank's) or more writes its sums past
// the caches: its ranks' y would not stay cached for the program's next reads anyway, and the
// stores then skip reading every line first (measured: docs/results/exact_p2p.md).
constexpr int64_t kStreamedSumBytes = 64 * 1024 * 1024;

// The handlers of an in-process two-shot sum of this many bytes of x (every rank's) or more
// await their calls (Call::AwaitInHandler); below it they return at once and the calls complete
// on the completion threads (measured faster in a model's decode step, where the ranks' steps
// between two all-reduces are short and a blocked handler thread costs more than a hand-over).
constexpr int64_t kAwaitedSumBytes = 64 * 1024;

// How long a handler of the in-process two-shot sum of `bytes` of x (every rank's) waits for
// its call before it returns the future open (Call::AwaitInHandler): 2 ms, and the time to read
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
    const int64_t per_piece = std::max<int64_t>(1, kPieceBytes / int64_t(item));
    std::shared_ptr<PushSum> sum;
    if (rank == 0) {
      sum = std::make_shared<PushSum>(dtype, count, per_piece, size,
                                      size * bytes >= kStreamedSumBytes);
    }
    const Spans published{mine[0], Span{out, y.size_bytes()}, Span{sum.get(), 0}, Span{}};
    const bool share = size * bytes >= kSharedSumBytes;
    const bool await = size * bytes >= kAwaitedSumBytes;
    if (await) call->ExpectAwait();
    call->Arrive(0, published, [=](const std::vector<Published>& peers) {
      (void)sum;
      static_cast<PushSum*>(const_cast<void*>(peers[0][2]))->Join(rank, call, peers, share);
    }, 0, /*inline_next=*/true);
    if (await) call->AwaitInHandler(AwaitInHandlerLimit(size * bytes));
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
