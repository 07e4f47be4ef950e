// The peer-to-peer transport on CPU: fused quantized collectives in one FFI call per rank,
// the ranks being the virtual CPU devices of one process (docs/transport.md). Each call
// quantizes into its own result buffers, meets its peers (p2p_rendezvous.h) and reads their
// buffers directly. The codec work is the same kernels, inputs and order as the `xla`
// transport's (jax_flashcomm/allreduce.py two_step), so the results are bit-identical to it.
//
// The handlers are asynchronous (they return an ffi::Future): a handler quantizes on XLA's
// thread, arrives at the first barrier and returns; each later step is a continuation that
// runs when every peer has arrived (p2p_rendezvous.h), and the last one completes the future.
// No thread waits for a peer, so neither XLA:CPU's shared thread pools nor the order in which
// each device's executor reaches independent collectives can deadlock the gang.
#include "flashcomm/cpu_p2p.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "flashcomm/cpu_alloc.h"
#include "flashcomm/cpu_dispatch.h"
#include "flashcomm/cpu_ops.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

using p2p::Meeting;
using p2p::Published;
using p2p::Rendezvous;

// Published[3] of a rank whose codec work failed (a scratch allocation): it still passes every
// barrier, so that no peer loses a buffer it reads, and every rank's call ends with an error.
const char kRankFailed = 0;

// One rank's part in one call: joined on creation, left when the call completes (success or
// error), which completes the call's future.
//
// A failure of this rank's codec work (Fail) does not leave the protocol: the rank skips the
// work that is left, passes its remaining barriers with the kRankFailed mark (peers may still
// read the buffers it published), and completes with the error; a peer that sees the mark
// completes with an error naming the rank. Continuations of one call run one after another, so
// the failure state needs no lock.
class Call : public std::enable_shared_from_this<Call> {
 public:
  static std::shared_ptr<Call> Join(const char* op, int64_t run_id, int64_t site,
                                    int32_t group, int32_t rank, int64_t size, int barriers,
                                    int64_t timeout_ms, std::string* error) {
    auto call = std::shared_ptr<Call>(new Call(op, rank));
    call->meeting_ = Rendezvous::Global().Join({run_id, site, group}, rank, int(size),
                                               barriers, error, timeout_ms);
    return call->meeting_ ? call : nullptr;
  }
  ~Call() {
    if (meeting_) Rendezvous::Global().Leave(meeting_);
  }
  ffi::Future future() const { return ffi::Future(promise_); }
  // Publish `mine` at `barrier` (marked kRankFailed once this rank has failed); `next` gets
  // every rank's pointers once all have arrived. On a failed meeting the call completes with
  // the error instead.
  void Arrive(int barrier, Published mine,
              std::function<void(const std::vector<Published>&)> next) {
    auto self = shared_from_this();
    if (failed()) mine[3] = &kRankFailed;
    meeting_->Arrive(barrier, rank_, mine,
                     [self, next = std::move(next)](const std::vector<Published>& peers,
                                                    const std::string& error) {
                       if (!error.empty()) return self->Finish(error);
                       for (size_t j = 0; j < peers.size() && !self->failed(); ++j) {
                         if (peers[j][3] == &kRankFailed) {
                           self->Fail(ffi::ErrorCode::kInternal,
                                      "rank " + std::to_string(j) +
                                          " failed (its own error says why)");
                         }
                       }
                       try {
                         next(peers);
                       } catch (const std::exception& e) {
                         // A small allocation of the protocol itself: fail the meeting, so
                         // that the peers do not wait for the deadline.
                         self->Abort(std::string("rank ") + std::to_string(self->rank_) +
                                     ": " + e.what());
                       }
                     });
  }
  // This rank's codec work failed: remember the first failure (Finish reports it).
  void Fail(ffi::ErrorCode code, const std::string& why) {
    if (failure_.empty()) {
      failure_ = why;
      failure_code_ = code;
    }
  }
  bool failed() const { return !failure_.empty(); }
  // Fail the whole meeting now (nothing of this rank's is published, or the protocol cannot go
  // on), then complete this call with `why`.
  void Abort(const std::string& why) {
    if (meeting_) meeting_->Abort("peer-to-peer collective: " + why);
    Fail(ffi::ErrorCode::kInternal, why);
    Finish();
  }
  // Complete the call (after its last barrier): leave the meeting, then set the future, with
  // `error` (a failed meeting) or this rank's failure (Fail) if any.
  void Finish(const std::string& error = std::string()) {
    if (meeting_) {
      Rendezvous::Global().Leave(meeting_);
      meeting_ = nullptr;
    }
    // Never on a worker: XLA continues the program on the completing thread.
    ffi::Promise promise = promise_;
    const std::string& why = error.empty() ? failure_ : error;
    const ffi::ErrorCode code = error.empty() ? failure_code_ : ffi::ErrorCode::kInternal;
    std::string message = why.empty() ? why : std::string(op_) + ": " + why;
    p2p::ThreadPool::Completions().Schedule([promise, message, code]() mutable {
      if (message.empty()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ffi::Error(code, message));
      }
    });
  }

 private:
  Call(const char* op, int rank) : op_(op), rank_(rank) {}

  const char* op_;
  int rank_;
  std::shared_ptr<Meeting> meeting_;
  ffi::Promise promise_;
  std::string failure_;
  ffi::ErrorCode failure_code_ = ffi::ErrorCode::kOk;
};

// The message of a kernel's failed scratch allocation (cpu_dispatch.h).
std::string ScratchMessage(size_t bytes, int rank) {
  return "could not allocate " + std::to_string(bytes) + " bytes of scratch memory (rank " +
         std::to_string(rank) + ")";
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  promise.SetError(std::move(error));
  return ffi::Future(promise);
}

ffi::Error CheckCommon(const char* op, ffi::AnyBuffer x, int32_t rank, int64_t size,
                       int64_t timeout_ms, int32_t rotation, int64_t group_size) {
  if (size < 1 || rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": timeout_ms must be positive");
  }
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard ||
      (rotation != kRotationNone && (group_size & (group_size - 1)) != 0)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": bad rotation for group_size");
  }
  DType dtype = DType::kF32;
  if (!ToDType(x.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32, bf16 or f16");
  }
  return ffi::Error::Success();
}

// A reusable per-thread buffer for the chunks read from the peers (grows, never shrinks;
// flashcomm_scratch_alloc, cpu_alloc.h). Null when it cannot grow to `bytes` (the old one is kept).
uint8_t* Scratch(size_t bytes) {
  struct Buffer {
    ~Buffer() { std::free(data); }
    uint8_t* data = nullptr;
    size_t size = 0;
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    auto* grown = static_cast<uint8_t*>(flashcomm_scratch_alloc(bytes));
    if (grown == nullptr) return nullptr;
    std::free(buffer.data);
    buffer.data = grown;
    buffer.size = bytes;
  }
  return buffer.data;
}

// Copies chunk `chunk` (gpc groups) of every peer's payload published at a barrier into one
// chunked payload (peers in rank order): the input of the fused sum kernels. False (and
// *failed_bytes, the size asked for) when the scratch buffer cannot be allocated.
bool GatherChunk(const std::vector<Published>& peers, int64_t chunk, int64_t gpc,
                 int64_t group_size, int bits, int spikes, PayloadView* out,
                 size_t* failed_bytes) {
  const int64_t n = int64_t(peers.size());
  const int64_t nb = record_bytes(group_size, bits, spikes);
  const size_t bytes = size_t(n * gpc * (nb + 4));
  uint8_t* buf = Scratch(bytes);
  if (buf == nullptr && bytes > 0) {
    *failed_bytes = bytes;
    return false;
  }
  uint8_t* codes = buf;
  auto* scale = reinterpret_cast<uint16_t*>(buf + n * gpc * nb);
  uint16_t* zero = scale + n * gpc;
  for (int64_t j = 0; j < n; ++j) {
    const auto* pc = static_cast<const uint8_t*>(peers[j][0]);
    const auto* ps = static_cast<const uint16_t*>(peers[j][1]);
    const auto* pz = static_cast<const uint16_t*>(peers[j][2]);
    std::memcpy(codes + j * gpc * nb, pc + chunk * gpc * nb, size_t(gpc * nb));
    std::memcpy(scale + j * gpc, ps + chunk * gpc, size_t(gpc) * 2);
    std::memcpy(zero + j * gpc, pz + chunk * gpc, size_t(gpc) * 2);
  }
  PayloadView view;
  view.codes = codes;
  view.scale = scale;
  view.zero = zero;
  view.batch = 1;
  view.chunks = n;
  view.groups_per_chunk = gpc;
  view.group_size = group_size;
  view.group_bytes = nb;
  view.bits = bits;
  view.spikes = spikes;
  *out = view;
  return true;
}

Published Publish(const void* codes, const void* scale, const void* zero) {
  return Published{codes, scale, zero, nullptr};
}

}  // namespace

#define FLASHCOMM_RETURN_IF_ERROR(expr)            \
  if (ffi::Error e_ = (expr); e_.failure()) {       \
    return Failed(std::move(e_));                   \
  }

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
  constexpr const char* kOp = "flashcomm_p2p_all_reduce";
  const int32_t rank = rank_buf.typed_data()[0];
  FLASHCOMM_RETURN_IF_ERROR(CheckCommon(kOp, x, rank, size, timeout_ms, rotation, group_size));
  int64_t n_groups = 0, n_out = 0;
  FLASHCOMM_RETURN_IF_ERROR(CheckQuantizeShapes(x, *p1_codes, *p1_scale, *p1_zero, bits,
                                                group_size, spikes, &n_groups));
  // An empty y: the caller decodes the gathered phase-2 payload itself (the fused epilogue,
  // docs/fused_norm.md), so step 3 stops after the gather.
  const bool decode = y->element_count() != 0;
  FLASHCOMM_RETURN_IF_ERROR(CheckQuantizeShapes(decode ? *y : x, *p2_codes, *p2_scale, *p2_zero,
                                                out_bits, group_size, out_spikes, &n_out));
  if (n_out != n_groups || n_groups % size != 0 ||
      (decode && y->element_type() != x.element_type())) {
    return Failed(ffi::Error::InvalidArgument(
        std::string(kOp) + ": y or the group count do not match x and the group size"));
  }
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const int64_t gpc = n_groups / size;
  const int64_t nb2 = record_bytes(group_size, out_bits, out_spikes);
  uint8_t* c2 = p2_codes->typed_data();
  auto* s2 = reinterpret_cast<uint16_t*>(p2_scale->typed_data());
  auto* z2 = reinterpret_cast<uint16_t*>(p2_zero->typed_data());
  void* out = y->untyped_data();

  // 1. Quantize the operand (N chunks) into this rank's phase-1 payload (on XLA's thread).
  const size_t quantize_failed = kernels().quantize(
      dtype, x.untyped_data(), n_groups, group_size, bits, rotation, spikes,
      p1_codes->typed_data(), reinterpret_cast<uint16_t*>(p1_scale->typed_data()),
      reinterpret_cast<uint16_t*>(p1_zero->typed_data()));
  std::string error;
  auto call = Call::Join(kOp, run.run_id, site, group_buf.typed_data()[0], rank, size, 3,
                         timeout_ms, &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(kOp) + ": " + error));
  ffi::Future done = call->future();
  if (quantize_failed != 0) {  // nothing published yet: the peers fail at once
    call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(quantize_failed, rank));
    call->Abort(ScratchMessage(quantize_failed, rank));
    return done;
  }
  call->Arrive(0, Publish(p1_codes->typed_data(), p1_scale->typed_data(),
                          p1_zero->typed_data()),
               [=](const std::vector<Published>& peers) {
    // 2. This rank's chunk from every peer, summed in f32 in rank order and re-quantized
    //    into its slot of the gathered phase-2 payload.
    PayloadView in;
    size_t failed = 0;
    if (!call->failed() &&
        (!GatherChunk(peers, rank, gpc, group_size, bits, spikes, &in, &failed) ||
         (failed = kernels().dequantize_sum_quantize(in, out_bits, out_spikes,
                                                     c2 + rank * gpc * nb2, s2 + rank * gpc,
                                                     z2 + rank * gpc, 0, in.batch * gpc)) != 0)) {
      call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(failed, rank));
    }
    call->Arrive(1, Publish(c2, s2, z2), [=](const std::vector<Published>& peers) {
      // 3. Every peer's reduced chunk into its slot, then decode the gathered payload.
      if (call->failed()) {
        return call->Arrive(2, Publish(nullptr, nullptr, nullptr),
                            [=](const std::vector<Published>&) { call->Finish(); });
      }
      for (int64_t j = 0; j < size; ++j) {
        if (j == rank) continue;
        std::memcpy(c2 + j * gpc * nb2,
                    static_cast<const uint8_t*>(peers[j][0]) + j * gpc * nb2,
                    size_t(gpc * nb2));
        std::memcpy(s2 + j * gpc, static_cast<const uint16_t*>(peers[j][1]) + j * gpc,
                    size_t(gpc) * 2);
        std::memcpy(z2 + j * gpc, static_cast<const uint16_t*>(peers[j][2]) + j * gpc,
                    size_t(gpc) * 2);
      }
      if (const size_t failed = !decode ? 0
                                : kernels().dequantize(dtype, c2, s2, z2, n_groups, group_size,
                                                       out_bits, rotation, out_spikes, out)) {
        call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(failed, rank));
      }
      // 4. Complete once every peer has read this rank's slot.
      call->Arrive(2, Publish(nullptr, nullptr, nullptr),
                   [=](const std::vector<Published>&) { call->Finish(); });
    });
  });
  return done;
}

ffi::Future P2pReduceScatter(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                             ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                             ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero, int32_t bits,
                             int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                             int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_reduce_scatter";
  const int32_t rank = rank_buf.typed_data()[0];
  FLASHCOMM_RETURN_IF_ERROR(CheckCommon(kOp, x, rank, size, timeout_ms, rotation, group_size));
  int64_t n_groups = 0;
  FLASHCOMM_RETURN_IF_ERROR(CheckQuantizeShapes(x, *p1_codes, *p1_scale, *p1_zero, bits,
                                                group_size, spikes, &n_groups));
  if (n_groups % size != 0 || int64_t(y->element_count()) * size != n_groups * group_size ||
      y->element_type() != x.element_type()) {
    return Failed(
        ffi::Error::InvalidArgument(std::string(kOp) + ": y must hold one chunk of x"));
  }
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const int64_t gpc = n_groups / size;
  void* out = y->untyped_data();
  const size_t quantize_failed = kernels().quantize(
      dtype, x.untyped_data(), n_groups, group_size, bits, rotation, spikes,
      p1_codes->typed_data(), reinterpret_cast<uint16_t*>(p1_scale->typed_data()),
      reinterpret_cast<uint16_t*>(p1_zero->typed_data()));
  std::string error;
  auto call = Call::Join(kOp, run.run_id, site, group_buf.typed_data()[0], rank, size, 2,
                         timeout_ms, &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(kOp) + ": " + error));
  ffi::Future done = call->future();
  if (quantize_failed != 0) {  // nothing published yet: the peers fail at once
    call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(quantize_failed, rank));
    call->Abort(ScratchMessage(quantize_failed, rank));
    return done;
  }
  call->Arrive(0, Publish(p1_codes->typed_data(), p1_scale->typed_data(),
                          p1_zero->typed_data()),
               [=](const std::vector<Published>& peers) {
    // This rank's chunk of every peer's payload (copied here), summed in f32 in rank order;
    // complete once every peer has read this rank's payload.
    PayloadView in;
    size_t failed = 0;
    if (!call->failed() &&
        (!GatherChunk(peers, rank, gpc, group_size, bits, spikes, &in, &failed) ||
         (failed = kernels().dequantize_sum(dtype, in, rotation, out, 0, in.batch * gpc)) !=
             0)) {
      call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(failed, rank));
    }
    call->Arrive(1, Publish(nullptr, nullptr, nullptr),
                 [=](const std::vector<Published>&) { call->Finish(); });
  });
  return done;
}

ffi::Future P2pAllGather(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                         ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::U8>> codes,
                         ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                         ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                         int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                         int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_gather";
  const int32_t rank = rank_buf.typed_data()[0];
  FLASHCOMM_RETURN_IF_ERROR(CheckCommon(kOp, x, rank, size, timeout_ms, rotation, group_size));
  int64_t n_groups = 0;
  FLASHCOMM_RETURN_IF_ERROR(CheckQuantizeShapes(x, *codes, *scale, *zero, bits, group_size,
                                                spikes, &n_groups));
  if (y->element_count() != x.element_count() * size || y->element_type() != x.element_type()) {
    return Failed(
        ffi::Error::InvalidArgument(std::string(kOp) + ": y must hold N copies of x"));
  }
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const size_t quantize_failed = kernels().quantize(
      dtype, x.untyped_data(), n_groups, group_size, bits, rotation, spikes, codes->typed_data(),
      reinterpret_cast<uint16_t*>(scale->typed_data()),
      reinterpret_cast<uint16_t*>(zero->typed_data()));
  std::string error;
  auto call = Call::Join(kOp, run.run_id, site, group_buf.typed_data()[0], rank, size, 2,
                         timeout_ms, &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(kOp) + ": " + error));
  ffi::Future done = call->future();
  if (quantize_failed != 0) {  // nothing published yet: the peers fail at once
    call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(quantize_failed, rank));
    call->Abort(ScratchMessage(quantize_failed, rank));
    return done;
  }
  const size_t slot_bytes = x.size_bytes();
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  call->Arrive(0, Publish(codes->typed_data(), scale->typed_data(), zero->typed_data()),
               [=](const std::vector<Published>& peers) {
    // Every rank's payload decoded straight from its buffer into its slot.
    for (int64_t j = 0; j < size && !call->failed(); ++j) {
      if (const size_t failed = kernels().dequantize(
              dtype, static_cast<const uint8_t*>(peers[j][0]),
              static_cast<const uint16_t*>(peers[j][1]),
              static_cast<const uint16_t*>(peers[j][2]), n_groups, group_size, bits, rotation,
              spikes, out + j * slot_bytes)) {
        call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(failed, rank));
      }
    }
    call->Arrive(1, Publish(nullptr, nullptr, nullptr),
                 [=](const std::vector<Published>&) { call->Finish(); });
  });
  return done;
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
