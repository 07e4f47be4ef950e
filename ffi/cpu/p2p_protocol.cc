// The peer-to-peer protocols on CPU (cpu/cpu_p2p_protocol.h), whichever gang carries them.
#include "cpu/cpu_p2p_protocol.h"

#include <optional>
#include <string>

namespace flashcomm {
namespace cpu {

ffi::Future AllReduceProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                              ffi::AnyBuffer& y, U8Buf& p1_codes, Bf16Buf& p1_scale,
                              Bf16Buf& p1_zero, U8Buf& p2_codes, Bf16Buf& p2_scale,
                              Bf16Buf& p2_zero, int32_t bits, int32_t out_bits, int64_t group_size,
                              int32_t rotation, int32_t spikes, int32_t out_spikes, int64_t size,
                              int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_reduce";
  // long function: the all-reduce's protocol: its barriers and their continuations, in order
  if (ffi::Error e = CheckCommon(kOp, x, rank, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return Failed(std::move(e));
  }
  int64_t n_groups = 0, n_out = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, p1_codes, p1_scale, p1_zero, bits, group_size,
                                         spikes, &n_groups);
      e.failure()) {
    return Failed(std::move(e));
  }
  // An empty y: the caller decodes the gathered phase-2 payload itself (the fused epilogue,
  // docs/fused_norm.md), so step 3 stops after the gather.
  const bool decode = y.element_count() != 0;
  if (ffi::Error e = CheckQuantizeShapes(decode ? y : x, p2_codes, p2_scale, p2_zero, out_bits,
                                         group_size, out_spikes, &n_out);
      e.failure()) {
    return Failed(std::move(e));
  }
  if (n_out != n_groups || n_groups % size != 0 ||
      (decode && y.element_type() != x.element_type())) {
    return Failed(ffi::Error::InvalidArgument(
        std::string(kOp) + ": y or the group count do not match x and the group size"));
  }
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const int64_t gpc = n_groups / size;
  const int64_t nb1 = record_bytes(group_size, bits, spikes);
  const int64_t nb2 = record_bytes(group_size, out_bits, out_spikes);
  uint8_t* c2 = p2_codes.typed_data();
  auto* s2 = reinterpret_cast<uint16_t*>(p2_scale.typed_data());
  auto* z2 = reinterpret_cast<uint16_t*>(p2_zero.typed_data());
  void* out = y.untyped_data();
  uint8_t* c1 = p1_codes.typed_data();
  auto* s1 = reinterpret_cast<uint16_t*>(p1_scale.typed_data());
  auto* z1 = reinterpret_cast<uint16_t*>(p1_zero.typed_data());

  // 1. Quantize the operand (N chunks) into this rank's phase-1 payload (on XLA's thread).
  const size_t quantize_failed = kernels().quantize(dtype, x.untyped_data(), n_groups,
                                                    group_size, bits, rotation, spikes, c1, s1,
                                                    z1);
  std::string error;
  auto call = Call::Join(kOp, rank, join, 3,
                         Describe({1, int64_t(x.element_type()), n_groups, decode, bits,
                                   out_bits, group_size, rotation, spikes, out_spikes, size}),
                         &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(kOp) + ": " + error));
  ffi::Future done = call->future();
  if (quantize_failed != 0) {  // nothing published yet: the peers fail at once
    call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(quantize_failed, rank));
    call->Abort(ScratchMessage(quantize_failed, rank));
    return done;
  }
  call->Arrive(0, PayloadSpans(c1, s1, z1, n_groups, nb1),
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
    call->Arrive(1, PayloadSpans(c2 + rank * gpc * nb2, s2 + rank * gpc, z2 + rank * gpc, gpc,
                                 nb2),
                 [=](const std::vector<Published>& peers) {
      // 3. Every peer's reduced chunk into its slot, then decode the gathered payload.
      if (call->failed()) {
        return call->Arrive(2, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
      }
      for (int64_t j = 0; j < size; ++j) {
        if (j == rank) continue;
        std::memcpy(c2 + j * gpc * nb2, peers[j][0], size_t(gpc * nb2));
        std::memcpy(s2 + j * gpc, peers[j][1], size_t(gpc) * 2);
        std::memcpy(z2 + j * gpc, peers[j][2], size_t(gpc) * 2);
      }
      if (const size_t failed = !decode ? 0
                                : kernels().dequantize(dtype, c2, s2, z2, n_groups, group_size,
                                                       out_bits, rotation, out_spikes, out)) {
        call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(failed, rank));
      }
      // 4. Complete once every peer has read this rank's slot.
      call->Arrive(2, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
    }, (size - 1) * gpc * (nb2 + 4));  // every peer reads this rank's slot
  }, (size - 1) * gpc * (nb1 + 4));  // each peer reads its chunk of this rank's payload
  return done;
}

namespace {

// The first steps of reduce-scatter (`kind` 2) and all-gather (3): the checks (`y_error`: what is
// wrong with y for x's `n_groups` groups, or null), this rank's payload quantized into
// codes / scale / zero, and the call joined. Null when the call is over: `*done` is then its
// result (an error, or the peers failed at once by a failed quantize).
template <typename YError>
std::shared_ptr<Call> QuantizeAndJoin(const char* op, int kind, const GangFactory& join,
                                      int32_t rank, const ffi::AnyBuffer& x,
                                      U8Buf& codes, Bf16Buf& scale,
                                      Bf16Buf& zero, int32_t bits,
                                      int64_t group_size, int32_t rotation, int32_t spikes,
                                      int64_t size, int64_t timeout_ms, YError y_error,
                                      int64_t* n_groups, std::optional<ffi::Future>* done) {
  if (ffi::Error e = CheckCommon(op, x, rank, size, timeout_ms, rotation, group_size);
      e.failure()) {
    done->emplace(Failed(std::move(e)));
    return nullptr;
  }
  if (ffi::Error e = CheckQuantizeShapes(x, codes, scale, zero, bits, group_size, spikes,
                                         n_groups);
      e.failure()) {
    done->emplace(Failed(std::move(e)));
    return nullptr;
  }
  if (const char* what = y_error(*n_groups)) {
    done->emplace(Failed(ffi::Error::InvalidArgument(std::string(op) + ": " + what)));
    return nullptr;
  }
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const size_t quantize_failed =
      kernels().quantize(dtype, x.untyped_data(), *n_groups, group_size, bits, rotation, spikes,
                         codes.typed_data(), reinterpret_cast<uint16_t*>(scale.typed_data()),
                         reinterpret_cast<uint16_t*>(zero.typed_data()));
  std::string error;
  auto call = Call::Join(op, rank, join, 2,
                         Describe({kind, int64_t(x.element_type()), *n_groups, bits, group_size,
                                   rotation, spikes, size}),
                         &error);
  if (!call) {
    done->emplace(Failed(ffi::Error::Internal(std::string(op) + ": " + error)));
    return nullptr;
  }
  done->emplace(call->future());
  if (quantize_failed != 0) {  // nothing published yet: the peers fail at once
    call->Fail(ffi::ErrorCode::kResourceExhausted, ScratchMessage(quantize_failed, rank));
    call->Abort(ScratchMessage(quantize_failed, rank));
    return nullptr;
  }
  return call;
}

}  // namespace

ffi::Future ReduceScatterProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                                  ffi::AnyBuffer& y, U8Buf& codes, Bf16Buf& scale, Bf16Buf& zero,
                                  int32_t bits, int64_t group_size, int32_t rotation,
                                  int32_t spikes, int64_t size, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_reduce_scatter";
  int64_t n_groups = 0;
  std::optional<ffi::Future> done;
  auto y_error = [&](int64_t groups) -> const char* {
    const bool fits = groups % size == 0 &&
                      int64_t(y.element_count()) * size == groups * group_size &&
                      y.element_type() == x.element_type();
    return fits ? nullptr : "y must hold one chunk of x";
  };
  auto call = QuantizeAndJoin(kOp, 2, join, rank, x, codes, scale, zero, bits, group_size,
                              rotation, spikes, size, timeout_ms, y_error, &n_groups, &done);
  if (!call) return std::move(*done);
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const int64_t gpc = n_groups / size;
  const int64_t nb = record_bytes(group_size, bits, spikes);
  void* out = y.untyped_data();
  uint8_t* c = codes.typed_data();
  auto* s = reinterpret_cast<uint16_t*>(scale.typed_data());
  auto* z = reinterpret_cast<uint16_t*>(zero.typed_data());
  call->Arrive(0, PayloadSpans(c, s, z, n_groups, nb), [=](const std::vector<Published>& peers) {
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
    call->Arrive(1, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
  }, (size - 1) * gpc * (nb + 4));  // each peer reads its chunk of this rank's payload
  return std::move(*done);
}

ffi::Future AllGatherProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                              ffi::AnyBuffer& y, U8Buf& codes, Bf16Buf& scale, Bf16Buf& zero,
                              int32_t bits, int64_t group_size, int32_t rotation, int32_t spikes,
                              int64_t size, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_gather";
  int64_t n_groups = 0;
  std::optional<ffi::Future> done;
  auto y_error = [&](int64_t) -> const char* {
    const bool fits = y.element_count() == x.element_count() * size &&
                      y.element_type() == x.element_type();
    return fits ? nullptr : "y must hold N copies of x";
  };
  auto call = QuantizeAndJoin(kOp, 3, join, rank, x, codes, scale, zero, bits, group_size,
                              rotation, spikes, size, timeout_ms, y_error, &n_groups, &done);
  if (!call) return std::move(*done);
  DType dtype = DType::kF32;
  ToDType(x.element_type(), &dtype);
  const int64_t nb = record_bytes(group_size, bits, spikes);
  uint8_t* c = codes.typed_data();
  auto* s = reinterpret_cast<uint16_t*>(scale.typed_data());
  auto* z = reinterpret_cast<uint16_t*>(zero.typed_data());
  const size_t slot_bytes = x.size_bytes();
  auto* out = static_cast<uint8_t*>(y.untyped_data());
  call->Arrive(0, PayloadSpans(c, s, z, n_groups, nb), [=](const std::vector<Published>& peers) {
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
    call->Arrive(1, Spans{}, [=](const std::vector<Published>&) { call->Finish(); });
  }, (size - 1) * n_groups * (nb + 4));  // every peer reads this rank's payload
  return std::move(*done);
}

}  // namespace cpu
}  // namespace flashcomm
