// nanobind module exposing the CUDA handlers as PyCapsules for
// jax.ffi.register_ffi_target(..., platform="CUDA"). Compiled by the host compiler; the CUDA
// runtime is linked statically (cudart_static), so importing it needs no GPU.
#include <nanobind/nanobind.h>

#include "flashcomm/cuda_kernels.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_flashcomm_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["flashcomm_quantize"] = EncapsulateFfiHandler(FlashcommQuantizeCuda);
    d["flashcomm_dequantize"] = EncapsulateFfiHandler(FlashcommDequantizeCuda);
    d["flashcomm_dequantize_sum"] = EncapsulateFfiHandler(FlashcommDequantizeSumCuda);
    d["flashcomm_dequantize_sum_quantize"] =
        EncapsulateFfiHandler(FlashcommDequantizeSumQuantizeCuda);
    return d;
  });
}
