// The ragged exchange on CPU (docs/alltoall.md): the rows of lax.ragged_all_to_all moved among
// a Gang, for any dtype, bytes as they are. Rank r sends rows [input_offsets[j],
// + send_sizes[j]) of its operand to rank j, which writes them at output_offsets[j] of its
// output (an offset in the receiver's output, given by the sender); the other rows of the output
// keep their values. jax_flashcomm.all_to_all and ragged_all_to_all run it on the raw operand
// (exact) or on the packed rows of the codec's payload (quantized).
// Written once over a Gang: the devices of one process (p2p_handlers.cc) and processes of one
// host over shared memory (shm_handlers.cc) run it alike.
#ifndef FLASHCOMM_CPU_EXCHANGE_H_
#define FLASHCOMM_CPU_EXCHANGE_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/exchange_checks.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// The sizes of one exchange: rows of the operand and of the output, and bytes per row.
struct ExchangeShape {
  int64_t in_rows = 0;
  int64_t out_rows = 0;
  int64_t row_bytes = 0;
};

// Rows and bytes per row of `buf` viewed as (dims[0], prod(dims[1:])).
inline void RowsOf(const ffi::AnyBuffer& buf, int64_t* rows, int64_t* row_bytes) {
  const auto dims = buf.dimensions();
  *rows = dims.size() == 0 ? 1 : dims[0];
  int64_t elems = 1;
  for (size_t i = 1; i < dims.size(); ++i) elems *= dims[i];
  *row_bytes = elems * int64_t(ffi::ByteWidth(buf.element_type()));
}

inline ffi::Error CheckExchange(const char* op, const ffi::AnyBuffer& operand,
                                const ffi::AnyBuffer& output, const ffi::AnyBuffer& out,
                                const std::vector<const ffi::Buffer<ffi::S32>*>& meta,
                                int32_t rank, int64_t size, int64_t timeout_ms,
                                ExchangeShape* shape) {
  if (size < 1 || rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": timeout_ms must be positive");
  }
  if (output.element_type() != operand.element_type() ||
      out.size_bytes() != output.size_bytes()) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": output must have the operand's dtype, out its size");
  }
  int64_t in_row = 0, out_row = 0;
  RowsOf(operand, &shape->in_rows, &in_row);
  RowsOf(output, &shape->out_rows, &out_row);
  if (in_row != out_row) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": operand and output rows differ in size");
  }
  shape->row_bytes = in_row;
  for (const auto* m : meta) {
    if (int64_t(m->element_count()) != size) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": offsets and sizes must have one entry per rank");
    }
  }
  return ffi::Error::Success();
}

// The exchange of this rank's operand rows into `out` (holding `output`'s values) among the gang
// `join` makes. Completes once every peer is done reading this rank's operand.
inline ffi::Future ExchangeProtocol(const char* op, const GangFactory& join, int32_t rank,
                                    const ffi::AnyBuffer& operand, const ffi::AnyBuffer& output,
                                    const ffi::Buffer<ffi::S32>& input_offsets,
                                    const ffi::Buffer<ffi::S32>& send_sizes,
                                    const ffi::Buffer<ffi::S32>& output_offsets,
                                    const ffi::Buffer<ffi::S32>& recv_sizes, ffi::AnyBuffer& out,
                                    int64_t size, int64_t timeout_ms) {
  ExchangeShape shape;
  if (ffi::Error e = CheckExchange(op, operand, output, out,
                                   {&input_offsets, &send_sizes, &output_offsets, &recv_sizes},
                                   rank, size, timeout_ms, &shape);
      e.failure()) {
    return Failed(std::move(e));
  }
  PassThrough(output, out);
  // what the peers read of this rank: its record, then its operand's rows
  auto meta = std::make_shared<std::vector<int64_t>>(exchange::RecordSize(size));
  for (int64_t j = 0; j < size; ++j) {
    (*meta)[j] = input_offsets.typed_data()[j];
    (*meta)[size + j] = send_sizes.typed_data()[j];
    (*meta)[2 * size + j] = output_offsets.typed_data()[j];
    (*meta)[3 * size + j] = recv_sizes.typed_data()[j];
  }
  (*meta)[4 * size] = shape.in_rows;
  (*meta)[4 * size + 1] = shape.out_rows;
  int64_t wire = 0;
  for (int64_t j = 0; j < size; ++j) {
    if (j != rank && send_sizes.typed_data()[j] > 0) {
      wire += send_sizes.typed_data()[j] * shape.row_bytes;
    }
  }
  std::string error;
  auto call = Call::Join(op, rank, join, 2,
                         Describe({9, int64_t(operand.element_type()), shape.row_bytes, size}),
                         &error);
  if (!call) return Failed(ffi::Error::Internal(std::string(op) + ": " + error));
  ffi::Future done = call->future();
  auto* dst = static_cast<uint8_t*>(out.untyped_data());
  const Spans mine{Span{operand.untyped_data(), operand.size_bytes()},
                   Span{meta->data(), meta->size() * 8}, Span{}, Span{}};
  call->Arrive(0, mine, [=](const std::vector<Published>& peers) {
    if (!call->failed()) {
      const std::string bad = exchange::BadExchange(
          [&peers](int64_t j) { return static_cast<const int64_t*>(peers[j][1]); }, size);
      if (!bad.empty()) call->Fail(ffi::ErrorCode::kInvalidArgument, bad);
    }
    for (int64_t j = 0; j < size && !call->failed(); ++j) {
      const auto* peer = static_cast<const int64_t*>(peers[j][1]);
      const int64_t n = peer[size + rank];
      if (n == 0) continue;
      std::memcpy(dst + peer[2 * size + rank] * shape.row_bytes,
                  static_cast<const uint8_t*>(peers[j][0]) + peer[rank] * shape.row_bytes,
                  size_t(n * shape.row_bytes));
    }
    // this rank's operand and offsets live until every peer has read them
    call->Arrive(1, Spans{}, [call, meta](const std::vector<Published>&) { call->Finish(); });
  }, wire);
  return done;
}

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_EXCHANGE_H_
