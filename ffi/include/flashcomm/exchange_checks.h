// The checks of a ragged exchange's offsets and sizes (ffi/cpu/cpu_exchange.h,
// ffi/cuda/exchange.h): every rank publishes a record and checks every pair of records, so every
// rank reports the same first bad pair.
#ifndef FLASHCOMM_EXCHANGE_CHECKS_H_
#define FLASHCOMM_EXCHANGE_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace flashcomm {
namespace exchange {

// The record each rank publishes: input_offsets, send_sizes, output_offsets, recv_sizes
// (N each), then its operand's and its output's rows.
inline size_t RecordSize(int64_t size) { return size_t(4 * size + 2); }

// Why rank `k` cannot take the rows rank `j` sends it; empty when it can (`sender`,
// `receiver`: their records).
template <typename T>
std::string BadRows(const T* sender, const T* receiver, int64_t size, int64_t j, int64_t k) {
  const int64_t in = sender[k], n = sender[size + k], at = sender[2 * size + k];
  const int64_t rows = sender[4 * size], out_rows = receiver[4 * size + 1];
  const std::string from = "rank " + std::to_string(j) + " -> rank " + std::to_string(k);
  if (n < 0 || in < 0 || at < 0) return from + ": a negative offset or size";
  if (in > rows - n) {
    return from + ": input rows [" + std::to_string(in) + ", " + std::to_string(in + n) +
           ") are outside the sender's " + std::to_string(rows) + " rows";
  }
  if (at > out_rows - n) {
    return from + ": output rows [" + std::to_string(at) + ", " + std::to_string(at + n) +
           ") are outside the receiver's " + std::to_string(out_rows) + " rows";
  }
  if (int64_t(receiver[3 * size + j]) != n) {
    return from + ": sends " + std::to_string(n) + " rows, the receiver's recv_sizes says " +
           std::to_string(int64_t(receiver[3 * size + j]));
  }
  return std::string();
}

// The first bad pair of the ranks' records (`record(j)`: rank j's), empty when none.
template <typename Record>
std::string BadExchange(Record record, int64_t size) {
  for (int64_t j = 0; j < size; ++j) {
    for (int64_t k = 0; k < size; ++k) {
      std::string bad = BadRows(record(j), record(k), size, j, k);
      if (!bad.empty()) return bad;
    }
  }
  return std::string();
}

}  // namespace exchange
}  // namespace flashcomm

#endif  // FLASHCOMM_EXCHANGE_CHECKS_H_
