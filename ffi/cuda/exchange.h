// The ragged exchange on CUDA, the CPU's (ffi/cpu/cpu_exchange.h) row for row: rank r sends rows
// [input_offsets[j], + send_sizes[j]) of its operand to rank j, which writes them at
// output_offsets[j] of its output; the other rows keep their values. Written once over a
// participant (p2p_protocol.h's interface): the GPUs of one process (p2p_handlers.cc) and
// processes of one host over CUDA IPC (shm_handlers.cc). `meet(barrier, data, bytes)` publishes
// one region of device memory (or none) and orders this stream after every peer's.
// Three barriers: the offsets (each rank reads every peer's to the host: the copies' sizes are
// host values), the operand, and the last (every peer is done reading this rank's buffers).
// NOT RUN ON HARDWARE: it compiles; no GPU has executed it (docs/alltoall.md).
// Plain C++ with the CUDA runtime API (host compiler).
#ifndef FLASHCOMM_CUDA_EXCHANGE_H_
#define FLASHCOMM_CUDA_EXCHANGE_H_

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "flashcomm/exchange_checks.h"
#include "flashcomm/ffi_checks.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {
namespace protocol {

// Rows of `buf` as (dims[0], prod(dims[1:])) and bytes per row.
inline void ExchangeRows(const ffi::AnyBuffer& buf, int64_t* rows, int64_t* row_bytes) {
  const auto dims = buf.dimensions();
  *rows = dims.size() == 0 ? 1 : dims[0];
  int64_t elems = 1;
  for (size_t i = 1; i < dims.size(); ++i) elems *= dims[i];
  *row_bytes = elems * int64_t(ffi::ByteWidth(buf.element_type()));
}

// What both handlers find before they join: the device made current, the rank and group read
// from device memory, the deadline.
struct ExchangeStart {
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  Clock::time_point deadline;
};

inline ffi::Error BeginExchange(const char* op, cudaStream_t stream,
                                ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                                int64_t size, int64_t timeout_ms, ExchangeStart* s) {
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + p2p::TimeoutError(timeout_ms));
  }
  s->deadline = p2p::DeadlineAfter(timeout_ms);
  return Start(op, stream, rank_buf, group_buf, size, s->deadline, &s->on, &s->device, &s->rank,
               &s->group);
}

// The exchange after the handler has joined `me` to a meeting of 3 barriers; `device`, `site`,
// `group` for the working memory, `deadline` for the host's wait on the offsets.
template <class P, class Meet>
ffi::Error Exchange(const char* op, P& me, Meet meet, cudaStream_t stream, int device,
                    int64_t site, int32_t group, int32_t rank, int64_t size,
                    const ffi::AnyBuffer& operand, const ffi::AnyBuffer& output,
                    const ffi::Buffer<ffi::S32>& input_offsets,
                    const ffi::Buffer<ffi::S32>& send_sizes,
                    const ffi::Buffer<ffi::S32>& output_offsets,
                    const ffi::Buffer<ffi::S32>& recv_sizes, ffi::AnyBuffer& out) {
  // long function: the checks and the three barriers of the protocol
  int64_t in_rows = 0, out_rows = 0, row = 0, out_row = 0;
  ExchangeRows(operand, &in_rows, &row);
  ExchangeRows(output, &out_rows, &out_row);
  if (row != out_row || output.element_type() != operand.element_type() ||
      out.size_bytes() != output.size_bytes()) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": output must have the operand's dtype and row shape");
  }
  for (const auto* m : {&input_offsets, &send_sizes, &output_offsets, &recv_sizes}) {
    if (int64_t(m->element_count()) != size) {
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": offsets and sizes must have one entry per rank");
    }
  }
  if (in_rows > INT32_MAX || out_rows > INT32_MAX) {
    return ffi::Error::InvalidArgument(std::string(op) + ": more than 2^31 - 1 rows");
  }
  const size_t record = exchange::RecordSize(size);
  const int32_t rows[2] = {int32_t(in_rows), int32_t(out_rows)};
  void* mem = nullptr;
  FLASHCOMM_CUDA_TRY(op, "allocating working memory",
                     Workspace(device, site, group, record * (size + 1) * 4, &mem));
  auto* mine = static_cast<int32_t*>(mem);
  int32_t* theirs = mine + record;  // every rank's record, rank-major
  if (out.untyped_data() != output.untyped_data()) {
    FLASHCOMM_CUDA_TRY(op, "copying output",
                       cudaMemcpyAsync(out.untyped_data(), output.untyped_data(),
                                       output.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  }
  const void* parts[4] = {input_offsets.untyped_data(), send_sizes.untyped_data(),
                          output_offsets.untyped_data(), recv_sizes.untyped_data()};
  for (int i = 0; i < 4; ++i) {
    FLASHCOMM_CUDA_TRY(op, "staging the offsets",
                       cudaMemcpyAsync(mine + i * size, parts[i], size_t(size) * 4,
                                       cudaMemcpyDeviceToDevice, stream));
  }
  FLASHCOMM_CUDA_TRY(op, "staging the rows",
                     cudaMemcpyAsync(mine + 4 * size, rows, 8, cudaMemcpyHostToDevice, stream));
  if (ffi::Error e = meet(0, mine, record * 4); e.failure()) return e;
  if (ffi::Error e = me.Prepare(); e.failure()) return e;
  for (int j = 0; j < size; ++j) {
    FLASHCOMM_CUDA_TRY(op, "copying a peer's offsets",
                       me.Copy(stream, theirs + j * record, j, me.peers()[j][0], record * 4));
  }
  std::vector<int32_t> host(record * size);
  FLASHCOMM_CUDA_TRY(op, "reading the offsets",
                     cudaMemcpyAsync(host.data(), theirs, host.size() * 4,
                                     cudaMemcpyDeviceToHost, stream));
  FLASHCOMM_CUDA_TRY(op, "waiting for the offsets", cudaStreamSynchronize(stream));
  const std::string bad = exchange::BadExchange(
      [&host, record](int64_t j) { return host.data() + j * record; }, size);
  // a bad record still passes the barriers (the peers would wait for it), copying nothing
  if (ffi::Error e = meet(1, operand.untyped_data(), operand.size_bytes()); e.failure()) {
    return e;
  }
  auto* dst = static_cast<uint8_t*>(out.untyped_data());
  for (int64_t j = 0; j < size && bad.empty(); ++j) {
    const int32_t* peer = host.data() + j * record;
    const int64_t n = peer[size + rank];
    if (n == 0) continue;
    FLASHCOMM_CUDA_TRY(op, "copying a peer's rows",
                       me.Copy(stream, dst + peer[2 * size + rank] * row, int(j),
                               static_cast<const uint8_t*>(me.peers()[j][0]) + peer[rank] * row,
                               size_t(n * row)));
  }
  if (ffi::Error e = meet(2, nullptr, 0); e.failure()) return e;
  if (!bad.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + bad);
  return ffi::Error::Success();
}

}  // namespace protocol
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_EXCHANGE_H_
