// The FFI signature of every flashcomm target, written once for both platforms. Each Bind*
// function appends an op's operands, results and attributes to `b`, a binding that already
// holds the platform's contexts (CPU: XLA's thread pool or the run id; CUDA: the stream, and the
// run id for the collectives), so a handler file reads
//
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommQuantizeCpu, ...,
//                                 bind::Quantize(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
//
// and its handler takes the contexts, then the arguments below in this order. Shapes and
// layouts: docs/format.md (payloads), docs/transport.md (collectives and ring steps).
#ifndef FLASHCOMM_BINDINGS_H_
#define FLASHCOMM_BINDINGS_H_

#include <utility>

#include "flashcomm/group_format.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace bind {

namespace ffi = xla::ffi;

// One payload of the integer format, as results: codes (..., record bytes) u8, then one bf16
// scale and one bf16 zero per group (...).
template <typename B>
auto PayloadRets(B&& b) {
  using U8 = ffi::Buffer<ffi::U8>;
  using Bf16 = ffi::Buffer<ffi::BF16>;
  return std::forward<B>(b).template Ret<U8>().template Ret<Bf16>().template Ret<Bf16>();
}

// The same payload as operands.
template <typename B>
auto PayloadArgs(B&& b) {
  using U8 = ffi::Buffer<ffi::U8>;
  using Bf16 = ffi::Buffer<ffi::BF16>;
  return std::forward<B>(b).template Arg<U8>().template Arg<Bf16>().template Arg<Bf16>();
}

// quantize: x (..., group_size) f32/bf16/f16 -> its payload.
template <typename B>
auto Quantize(B&& b) {
  return PayloadRets(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // x
      .template Attr<GroupFormat>("fmt");                          // the payload's format
}

// dequantize: payload (..., groups) -> y (..., groups, group_size); dequantize_sum: chunked
// payload (..., N, groups) -> y (..., groups, group_size), the f32 sum over N.
template <typename B>
auto Dequantize(B&& b) {
  return PayloadArgs(std::forward<B>(b))
      .template Ret<ffi::AnyBuffer>()      // y: f32, bf16 or f16
      .template Attr<GroupFormat>("fmt");  // the payload's format
}

// dequantize_sum_quantize: chunked payload (..., N, groups) -> the f32 sum over N quantized,
// payload (..., groups).
template <typename B>
auto DequantizeSumQuantize(B&& b) {
  return PayloadRets(PayloadArgs(std::forward<B>(b)))
      .template Attr<GroupFormat>("fmt")       // the input's format
      .template Attr<GroupFormat>("out_fmt");  // the output's (its group_size is the input's)
}

// dequantize_into: decodes a payload into `out` at element `offset`, in place.
template <typename B>
auto DequantizeInto(B&& b) {
  return PayloadArgs(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // out: f32/bf16/f16
      .template Arg<ffi::Buffer<ffi::S32>>()  // offset: () the first element written
      .template Ret<ffi::AnyBuffer>()         // out, aliased to operand 0
      .template Attr<GroupFormat>("fmt")      // the payload's format
      .template Attr<int64_t>("count");       // values written (the chunk's elements)
}

// fp_quantize: x (..., group_size) -> records (..., record bytes) of a floating-point format.
template <typename B>
auto FpQuantize(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()          // x: f32, bf16 or f16
      .template Ret<ffi::Buffer<ffi::U8>>()    // records
      .template Attr<GroupFormat>("fmt");      // fp8, mxfp4 or nvfp4
}

// fp_dequantize: records (..., groups, bytes) -> y (..., groups, group_size); fp_dequantize_sum:
// records (..., N, groups, bytes) -> y, the f32 sum over N.
template <typename B>
auto FpDequantize(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::Buffer<ffi::U8>>()  // records
      .template Ret<ffi::AnyBuffer>()        // y: f32, bf16 or f16
      .template Attr<GroupFormat>("fmt");    // the records' format
}

// fp_dequantize_sum_quantize: records (..., N, groups, bytes) -> the sum's records (..., groups,
// bytes').
template <typename B>
auto FpDequantizeSumQuantize(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::Buffer<ffi::U8>>()    // records
      .template Ret<ffi::Buffer<ffi::U8>>()    // the sum's records
      .template Attr<GroupFormat>("fmt")       // the input's format
      .template Attr<GroupFormat>("out_fmt");  // the output's (same group_size)
}

// The fused decode + residual add + RMSNorm's operands (docs/fused_norm.md): one payload
// (groups,) and the residual (..., hidden) and weight (hidden,).
template <typename B>
auto NormArgs(B&& b) {
  return PayloadArgs(std::forward<B>(b))
      .template Arg<ffi::AnyBuffer>()   // residual: (..., hidden) f32/bf16/f16
      .template Arg<ffi::AnyBuffer>()   // weight: (hidden,) f32 or bf16
      .template Ret<ffi::AnyBuffer>();  // new residual: residual's shape and dtype
}

// add_rms_norm: -> (new residual, normalised output).
template <typename B>
auto AddRmsNorm(B&& b) {
  return NormArgs(std::forward<B>(b))
      .template Ret<ffi::AnyBuffer>()      // the normalised output: residual's shape and dtype
      .template Attr<GroupFormat>("fmt")   // the payload's format
      .template Attr<float>("eps");        // added to the mean square
}

// add_rms_norm_quantize: -> (new residual, the normalised output's payload).
template <typename B>
auto AddRmsNormQuantize(B&& b) {
  return PayloadRets(NormArgs(std::forward<B>(b)))  // the output's payload: (groups',)
      .template Attr<GroupFormat>("fmt")       // the input payload's format
      .template Attr<float>("eps")             // added to the mean square
      .template Attr<GroupFormat>("out_fmt");  // the output's: bits and group_size read
}

// Who meets whom in a collective: the devices of one process (the in-process rendezvous) or
// processes of one host (the shared-memory meeting point, which also keys on the mesh axes).
enum class Peers { kInProcess, kShared };

// Every collective's operands after its data: the rank (lax.axis_index over the reduced axes,
// lax's tuple order) and the replica group (index over the mesh axes not reduced).
template <typename B>
auto RankArgs(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::Buffer<ffi::S32>>()   // rank: () in 0..N-1
      .template Arg<ffi::Buffer<ffi::S32>>();  // group: () the replica group's index
}

// Appends the int64 attribute `last`, then, for a call among processes, the mesh axes' key
// (a hash of their names).
template <Peers kPeers, typename B>
auto ThenKey(B&& b, const char* last) {
  if constexpr (kPeers == Peers::kShared) {
    return std::forward<B>(b).template Attr<int64_t>(last).template Attr<int64_t>("axes_key");
  } else {
    return std::forward<B>(b).template Attr<int64_t>(last);
  }
}

// The meeting's attributes of a collective among peers `kPeers`: ranks in the replica group,
// the call site (the peers of one call share it) and timeout_ms (every wait gives up after it).
template <Peers kPeers, typename B>
auto MeetingAttrs(B&& b) {
  return ThenKey<kPeers>(
      std::forward<B>(b).template Attr<int64_t>("size").template Attr<int64_t>("site"),
      "timeout_ms");
}

// p2p / shm all_reduce: x (N * groups_per_chunk, group_size) -> y (x's shape, or empty: no
// decode), this rank's phase-1 payload (N, groups_per_chunk) and the gathered phase-2 payload
// (N * groups_per_chunk).
template <Peers kPeers, typename B>
auto AllReduce(B&& b) {
  auto rets = RankArgs(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // x
                  .template Ret<ffi::AnyBuffer>();                   // y
  return MeetingAttrs<kPeers>(PayloadRets(PayloadRets(std::move(rets)))
                                  .template Attr<GroupFormat>("fmt")        // phase 1
                                  .template Attr<GroupFormat>("out_fmt"));  // phase 2
}

// p2p / shm reduce_scatter: x (N * groups_per_chunk, group_size) -> y (groups_per_chunk,
// group_size), chunk `rank` of the sum, and this rank's payload (N, groups_per_chunk);
// all_gather: x (groups, group_size) -> y (N, groups, group_size), rank j's in slot j, and this
// rank's payload (groups,).
template <Peers kPeers, typename B>
auto ReduceScatter(B&& b) {
  auto rets = RankArgs(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // x
                  .template Ret<ffi::AnyBuffer>();                   // y
  return MeetingAttrs<kPeers>(
      PayloadRets(std::move(rets)).template Attr<GroupFormat>("fmt"));  // the payload's
}

// p2p / shm psum: the exact all-reduce, x (any shape, f32/bf16/f16) -> y, the sum in f32 in
// rank order rounded once.
template <Peers kPeers, typename B>
auto Psum(B&& b) {
  auto rets = RankArgs(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // x
                  .template Ret<ffi::AnyBuffer>();                   // y
  return MeetingAttrs<kPeers>(std::move(rets))
      .template Attr<int32_t>("two_shot")         // 0 one shot, 1 two shots, 2 by size
      .template Attr<int64_t>("two_shot_bytes");  // with 2: two shots from these bytes per rank
}

// p2p / shm exchange: the rows of a ragged all-to-all (ffi/cpu/cpu_exchange.h), any dtype;
// out is output with the received rows written, aliased to it.
template <Peers kPeers, typename B>
auto Exchange(B&& b) {
  auto args = std::forward<B>(b)
                  .template Arg<ffi::AnyBuffer>()          // operand: (rows, ...) sent
                  .template Arg<ffi::AnyBuffer>()          // output: (rows', ...) received into
                  .template Arg<ffi::Buffer<ffi::S32>>()   // input_offsets: (N,) operand rows
                  .template Arg<ffi::Buffer<ffi::S32>>()   // send_sizes: (N,) rows to rank j
                  .template Arg<ffi::Buffer<ffi::S32>>()   // output_offsets: (N,) at rank j
                  .template Arg<ffi::Buffer<ffi::S32>>();  // recv_sizes: (N,) from rank j
  return MeetingAttrs<kPeers>(RankArgs(std::move(args))
                                  .template Ret<ffi::AnyBuffer>());  // out: output, aliased
}

// The ring start's attributes before its own: rank r sends to r + shift and receives from
// r - shift; the ranks' calls of one step share the site.
template <typename B>
auto RingAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<int64_t>("size")    // ranks in the ring
      .template Attr<int64_t>("shift")   // r sends to r + shift
      .template Attr<int64_t>("site");   // the call site
}

// ring_start: publishes `send` and the receive buffer and returns at once (docs/transport.md,
// "Ring steps").
template <Peers kPeers, typename B>
auto RingStart(B&& b) {
  auto rets = RankArgs(std::forward<B>(b).template Arg<ffi::AnyBuffer>())  // send: the chunk
                  .template Ret<ffi::AnyBuffer>()          // send_out: send, aliased
                  .template Ret<ffi::AnyBuffer>()          // recv: the chunk of rank - shift
                  .template Ret<ffi::Buffer<ffi::S32>>();  // order: () zero, for slice offsets
  // timeout_ms: the step fails after it; link_bytes_per_s: 0, or an emulated link's rate (CPU).
  return ThenKey<kPeers>(RingAttrs(std::move(rets)).template Attr<int64_t>("timeout_ms"),
                         "link_bytes_per_s");
}

// ring_done: completes once the chunk has arrived and this rank's send buffer was read.
template <Peers kPeers, typename B>
auto RingDone(B&& b) {
  auto args = std::forward<B>(b)
                  .template Arg<ffi::AnyBuffer>()   // recv: start's result, the chunk arriving
                  .template Arg<ffi::AnyBuffer>()   // send: start's send_out
                  .template Arg<ffi::AnyBuffer>();  // after: the step's dot, run before this
  return ThenKey<kPeers>(RankArgs(std::move(args))
                             .template Ret<ffi::AnyBuffer>()   // recv_out: recv, aliased
                             .template Ret<ffi::AnyBuffer>()   // after_out: after, aliased
                             .template Attr<int64_t>("size")   // ranks in the ring
                             .template Attr<int64_t>("shift"),  // r sends to r + shift
                         "site");
}

}  // namespace bind
}  // namespace flashcomm

// Defines a codec family's four handlers with `HANDLER` (FLASHCOMM_CPU_POOL_HANDLER or
// FLASHCOMM_CUDA_STREAM_HANDLER): stem P<Op> from NS::P<Op>SUFFIX, bound as above (P: empty
// for the integer format, Fp for the floating-point ones); dequantize_sum binds as dequantize.
#define FLASHCOMM_CODEC_FAMILY(HANDLER, NS, P, SUFFIX)                          \
  HANDLER(P##Quantize, NS::P##Quantize##SUFFIX, P##Quantize);                   \
  HANDLER(P##Dequantize, NS::P##Dequantize##SUFFIX, P##Dequantize);             \
  HANDLER(P##DequantizeSum, NS::P##DequantizeSum##SUFFIX, P##Dequantize);       \
  HANDLER(P##DequantizeSumQuantize, NS::P##DequantizeSumQuantize##SUFFIX,       \
          P##DequantizeSumQuantize)

#endif  // FLASHCOMM_BINDINGS_H_
