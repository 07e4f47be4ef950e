// A chunked codec payload as the handlers see it, shared by the CPU and CUDA handlers and by
// every CPU instruction-set build (so it lives outside codec.h's per-ISA namespace).
#ifndef FLASHCOMM_PAYLOAD_VIEW_H_
#define FLASHCOMM_PAYLOAD_VIEW_H_

#include <cstdint>

namespace flashcomm {

// A payload with a chunk axis: codes (batch..., chunks, groups_per_chunk, group_bytes),
// scale and zero (batch..., chunks, groups_per_chunk).
struct PayloadView {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t batch;
  int64_t chunks;
  int64_t groups_per_chunk;
  int64_t group_size;
  int64_t group_bytes;  // of one group's record: packed codes, then the spike record
  int bits;
  int spikes;
};

}  // namespace flashcomm

#endif  // FLASHCOMM_PAYLOAD_VIEW_H_
