// nanobind module exposing the CUDA handlers as PyCapsules for
// jax.ffi.register_ffi_target(..., platform="CUDA"). Compiled by the host compiler; the CUDA
// runtime is linked statically (cudart_static), so importing it needs no GPU.
#include "flashcomm/cuda_kernels.h"
#include "flashcomm/nb_registrations.h"

NB_MODULE(_flashcomm_cuda, m) {
  m.def("registrations", []() {
    return flashcomm::Registrations(FlashcommQuantizeCuda, FlashcommDequantizeCuda,
                                    FlashcommDequantizeSumCuda,
                                    FlashcommDequantizeSumQuantizeCuda,
                                    FlashcommDequantizeIntoCuda);
  });
}
