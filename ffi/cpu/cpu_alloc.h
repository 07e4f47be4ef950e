// The CPU codec's scratch memory: every scratch allocation of the kernels (ffi/cpu/
// isa_kernels.cc, and the p2p transport's receive buffers of ffi/cpu/p2p_handlers.cc) goes
// through flashcomm_scratch_alloc, which returns null when the memory is not there (never
// throws); the kernels report that as the size that failed (cpu_dispatch.h) and the handlers
// turn it into an ffi::Error (ResourceExhausted) naming the op and the size.
//
// Declarations only, defined in ffi/cpu/dispatch.cc (compiled for the baseline ISA): no inline
// function or template here, so nothing of it is compiled into an ISA build's namespace (see the
// top of isa_kernels.cc). The cost is one indirect call per scratch allocation, next to malloc.
#ifndef FLASHCOMM_CPU_ALLOC_H_
#define FLASHCOMM_CPU_ALLOC_H_

#include <stddef.h>

// C linkage, outside namespace flashcomm: an ISA build opens flashcomm's namespaces inline in its
// own (FLASHCOMM_ISA), where a C++ declaration would name a different, undefined function.
extern "C" {

typedef void* (*flashcomm_scratch_alloc_fn)(size_t bytes);

// `bytes` (> 0) of scratch from the allocator in use (std::malloc unless a test replaced it);
// null on failure. Freed with std::free.
void* flashcomm_scratch_alloc(size_t bytes);

// Test-only: the allocator flashcomm_scratch_alloc calls from now on (nullptr: std::malloc
// again). Returns the previous one (nullptr when it was std::malloc). Tests make allocations
// fail with it.
flashcomm_scratch_alloc_fn flashcomm_set_scratch_allocator(flashcomm_scratch_alloc_fn fn);

}  // extern "C"

#endif  // FLASHCOMM_CPU_ALLOC_H_
