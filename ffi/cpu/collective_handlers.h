// The quantized collectives' FFI handlers on CPU, written once over who the peers are: the
// protocols of cpu_p2p_protocol.h over the Gang that `Peers::Join` makes. p2p_handlers.cc
// instantiates them for the devices of one process (the in-process rendezvous),
// shm_handlers.cc for processes of one host (the shared-memory meeting point, keyed also by the
// mesh axes: the trailing `Key` attribute). Their bindings: flashcomm/bindings.h.
#ifndef FLASHCOMM_CPU_COLLECTIVE_HANDLERS_H_
#define FLASHCOMM_CPU_COLLECTIVE_HANDLERS_H_

#include <cstdint>

#include "cpu/cpu_ops.h"
#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/bindings.h"
#include "flashcomm/group_format.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

namespace ffi = xla::ffi;

template <typename Peers, typename... Key>
ffi::Future AllReduceHandler(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf, AnyOut y, U8Out p1_codes,
                             Bf16Out p1_scale, Bf16Out p1_zero, U8Out p2_codes, Bf16Out p2_scale,
                             Bf16Out p2_zero, GroupFormat fmt, GroupFormat out_fmt, int64_t size,
                             int64_t site, int64_t timeout_ms, Key... key) {
  const int32_t rank = rank_buf.typed_data()[0];
  return AllReduceProtocol(
      Peers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms, key...), rank, x,
      *y, *p1_codes, *p1_scale, *p1_zero, *p2_codes, *p2_scale, *p2_zero, fmt.bits, out_fmt.bits,
      fmt.group_size, fmt.rotation, fmt.spikes, out_fmt.spikes, size, timeout_ms);
}

// reduce_scatter and all_gather: x -> y and one payload (`Protocol` of cpu_p2p_protocol.h).
template <auto Protocol, typename Peers, typename... Key>
ffi::Future PayloadHandler(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                           ffi::Buffer<ffi::S32> group_buf, AnyOut y, U8Out codes, Bf16Out scale,
                           Bf16Out zero, GroupFormat fmt, int64_t size, int64_t site,
                           int64_t timeout_ms, Key... key) {
  const int32_t rank = rank_buf.typed_data()[0];
  return Protocol(Peers::Join(run, site, group_buf.typed_data()[0], rank, size, timeout_ms,
                              key...),
                  rank, x, *y, *codes, *scale, *zero, fmt.bits, fmt.group_size, fmt.rotation,
                  fmt.spikes, size, timeout_ms);
}

}  // namespace cpu
}  // namespace flashcomm

// The three quantized collectives' handler symbols `Flashcomm<Prefix>AllReduceCpu`, ...
// ReduceScatterCpu and ...AllGatherCpu among `kPeers` (bindings.h), from the templates above.
#define FLASHCOMM_DEFINE_CPU_COLLECTIVES(Prefix, kPeers, ...)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##AllReduceCpu,                                                        \
      (flashcomm::cpu::Guard<&flashcomm::cpu::AllReduceHandler<__VA_ARGS__>>::Call),          \
      flashcomm::bind::AllReduce<kPeers>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()));      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##ReduceScatterCpu,                                                    \
      (flashcomm::cpu::Guard<&flashcomm::cpu::PayloadHandler<                                 \
           &flashcomm::cpu::ReduceScatterProtocol, __VA_ARGS__>>::Call),                      \
      flashcomm::bind::ReduceScatter<kPeers>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()));  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      Flashcomm##Prefix##AllGatherCpu,                                                        \
      (flashcomm::cpu::Guard<&flashcomm::cpu::PayloadHandler<                                 \
           &flashcomm::cpu::AllGatherProtocol, __VA_ARGS__>>::Call),                          \
      flashcomm::bind::ReduceScatter<kPeers>(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()))

#endif  // FLASHCOMM_CPU_COLLECTIVE_HANDLERS_H_
