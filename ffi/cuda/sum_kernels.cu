// The exact all-reduce's sum on CUDA (exact_sum.h: flashcomm_p2p_psum, flashcomm_shm_psum):
// every rank's values summed in f32 in rank order and rounded once to the dtype, the CPU
// handlers' SumRanks (ffi/cpu/cpu_exact_sum.h) value for value. One thread per value, grid-stride.
#include <cuda_runtime.h>

#include <cstdint>

#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t(1) << 15;

// y[i] = sum over j in 0..ranks-1 of in[j * stride + i], for i in [0, count).
template <typename T>
__global__ void SumRanksKernel(const typename T::Storage* __restrict__ in, int64_t stride,
                               int ranks, int64_t count, typename T::Storage* __restrict__ y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float acc = T::load(in[i]);
    for (int j = 1; j < ranks; ++j) acc += T::load(in[j * stride + i]);
    y[i] = T::store(acc);
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchSumRanks(cudaStream_t stream, const void* in, int64_t stride, int ranks,
                           int64_t count, void* y) {
  if (count <= 0 || ranks <= 0) return cudaSuccess;
  using S = typename T::Storage;
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  SumRanksKernel<T><<<unsigned(blocks < kMaxGrid ? blocks : kMaxGrid), kThreads, 0, stream>>>(
      static_cast<const S*>(in), stride, ranks, count, static_cast<S*>(y));
  return cudaGetLastError();
}

template cudaError_t LaunchSumRanks<F32>(cudaStream_t, const void*, int64_t, int, int64_t,
                                         void*);
template cudaError_t LaunchSumRanks<BF16>(cudaStream_t, const void*, int64_t, int, int64_t,
                                          void*);
template cudaError_t LaunchSumRanks<F16>(cudaStream_t, const void*, int64_t, int, int64_t,
                                         void*);

}  // namespace cuda
}  // namespace flashcomm
