// Declarations of the CPU FFI handler symbols (defined in ffi/cpu/codec_kernels.cc, and
// ffi/cpu/gather_kernels.cc for FlashcommDequantizeIntoCpu).
#ifndef FLASHCOMM_CPU_KERNELS_H_
#define FLASHCOMM_CPU_KERNELS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeSumQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommDequantizeIntoCpu);
// The floating-point formats (ffi/cpu/fp_kernels.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeSumCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommFpDequantizeSumQuantizeCpu);
// ffi/cpu/norm_kernels.cc: the fused residual add + RMSNorm (docs/fused_norm.md).
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommAddRmsNormCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlashcommAddRmsNormQuantizeCpu);

#endif  // FLASHCOMM_CPU_KERNELS_H_
