// What an XLA FFI handler declares about itself: its FFI API version and its traits (such as
// XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE), read the way XLA reads them when the
// handler is registered: a call with a call frame that carries only the metadata extension
// (xla/ffi/api/api.h, Handler::Call -> PopulateMetadata). No device, stream or XLA runtime is
// involved, so it works on a machine without a GPU. Host-only (never included by .cu files).
#ifndef FLASHCOMM_HANDLER_METADATA_H_
#define FLASHCOMM_HANDLER_METADATA_H_

#include <cstdint>

#include "xla/ffi/api/c_api.h"

namespace flashcomm {

struct HandlerMetadata {
  bool ok = false;        // the handler answered the metadata call
  int api_major = -1;     // the FFI API version of the headers it was compiled with
  int api_minor = -1;
  uint32_t traits = 0;    // XLA_FFI_Handler_TraitsBits
};

// Calls `handler` with a metadata-only call frame, `api` null as in XLA's own GetMetadata
// (xla/ffi/ffi_api.cc). The handler touches `api` only to report a struct-size mismatch; the
// sizes here come from the same headers the handler was compiled with, so there is none. For
// handlers of this project's modules only (a foreign handler built against other headers
// could mismatch and would then dereference the null `api`).
inline HandlerMetadata QueryHandlerMetadata(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  metadata.api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.extension_base.next = nullptr;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.api = nullptr;
  frame.ctx = nullptr;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  frame.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  frame.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  HandlerMetadata out;
  if (handler(&frame) != nullptr) return out;  // not reached with matching headers
  out.ok = true;
  out.api_major = metadata.api_version.major_version;
  out.api_minor = metadata.api_version.minor_version;
  out.traits = metadata.traits;
  return out;
}

}  // namespace flashcomm

#endif  // FLASHCOMM_HANDLER_METADATA_H_
