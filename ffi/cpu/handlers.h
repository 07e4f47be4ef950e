// The CPU FFI handler symbols, Flashcomm<stem>Cpu for every target of flashcomm/targets.def
// (defined in the *_handlers.cc files of ffi/cpu), and the counters module.cc exposes.
#ifndef FLASHCOMM_CPU_HANDLERS_H_
#define FLASHCOMM_CPU_HANDLERS_H_

#include <cstddef>

#include "xla/ffi/api/api.h"

#define FLASHCOMM_TARGET(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(Flashcomm##stem##Cpu);
#include "flashcomm/targets.def"

// Defines Flashcomm<stem>Cpu: `fn` bound by flashcomm::bind::<Op> (flashcomm/bindings.h) after
// XLA's intra-op thread pool.
#define FLASHCOMM_CPU_POOL_HANDLER(stem, fn, Op) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                   \
      Flashcomm##stem##Cpu, fn,                    \
      flashcomm::bind::Op(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()))

// Defines Flashcomm<Prefix>RingStartCpu and ...RingDoneCpu: flashcomm::cpu::<Prefix>RingStart
// and <Prefix>RingDone (cpu_ops.h Guard), bound by bind::RingStart / RingDone<kPeers> after
// `binding`'s contexts.
#define FLASHCOMM_DEFINE_CPU_RING(Prefix, kPeers, binding)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                   \
      Flashcomm##Prefix##RingStartCpu,                                             \
      (flashcomm::cpu::Guard<&flashcomm::cpu::Prefix##RingStart>::Call),           \
      flashcomm::bind::RingStart<kPeers>(binding));                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                   \
      Flashcomm##Prefix##RingDoneCpu,                                              \
      (flashcomm::cpu::Guard<&flashcomm::cpu::Prefix##RingDone>::Call),            \
      flashcomm::bind::RingDone<kPeers>(binding))

namespace flashcomm {
namespace cpu {

// Peer-to-peer meetings (in-process rendezvous) not yet finished by every rank.
size_t P2pMeetingsInProgress();
// Ring steps some rank has not finished, in-process and between processes.
size_t P2pRingStepsInProgress();
size_t ShmRingStepsInProgress();

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_HANDLERS_H_
