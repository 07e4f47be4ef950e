// Declarations of the CUDA FFI handler symbols (defined in ffi/cuda/codec_handlers.cc, and
// ffi/cuda/gather_handlers.cc for FlashcommDequantizeIntoCuda; the kernels they launch are in
// ffi/cuda/*.cu).
// Deliberately free of CUDA headers: ffi/cuda/module.cc (nanobind, host compiler) includes it.
#ifndef FLASHCOMM_CUDA_KERNELS_H_
#define FLASHCOMM_CUDA_KERNELS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeIntoCuda);

#endif  // FLASHCOMM_CUDA_KERNELS_H_
