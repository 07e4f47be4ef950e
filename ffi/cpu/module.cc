// nanobind module exposing the CPU handlers as PyCapsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "flashcomm/cpu_kernels.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_flashcomm_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["flashcomm_quantize"] = EncapsulateFfiHandler(FlashcommQuantizeCpu);
    d["flashcomm_dequantize"] = EncapsulateFfiHandler(FlashcommDequantizeCpu);
    d["flashcomm_dequantize_sum"] = EncapsulateFfiHandler(FlashcommDequantizeSumCpu);
    d["flashcomm_dequantize_sum_quantize"] = EncapsulateFfiHandler(FlashcommDequantizeSumQuantizeCpu);
    return d;
  });
}
