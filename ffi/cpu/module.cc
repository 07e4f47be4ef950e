// nanobind module exposing the CPU handlers as PyCapsules for jax.ffi.register_ffi_target.
#include "flashcomm/cpu_kernels.h"
#include "flashcomm/nb_registrations.h"

NB_MODULE(_flashcomm_cpu, m) {
  m.def("registrations", []() {
    return flashcomm::Registrations(FlashcommQuantizeCpu, FlashcommDequantizeCpu,
                                    FlashcommDequantizeSumCpu, FlashcommDequantizeSumQuantizeCpu,
                                    FlashcommDequantizeIntoCpu);
  });
}
