// Ring steps between processes on CUDA (one GPU each): the start / done pair of the CPU
// handlers (ffi/cpu/shm_ring_handlers.cc) with their operands, results and attributes, over CUDA
// IPC (ipc_participant.h; docs/cuda.md, "Across processes: CUDA IPC").
//
// start: passes `send` through to `send_out`, zeroes `order`, reads the rank and group (a host
// sync, as every handler here), stages send_out and meets every rank at the step's first
// barrier (this stream then waits on every peer's staging event). The chunk of rank - shift then
// moves into `recv` on this device's link stream, which waits for that point of this stream:
// the copy runs while this stream runs the step's dot. An "arrived" event closes it.
// done: makes this stream wait on the arrived event, passes recv and after through, and meets
// every rank at the step's last barrier (every peer has read this rank's staged chunk; the
// staging buffer may be reused).
// Compiles and lowers; NOT RUN ON HARDWARE (the collectives of shm_handlers.cc ran on one H200;
// these steps have not). Not CUDA-graph safe: no command-buffer trait.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "cpu/shm_rendezvous.h"
#include "handlers.h"
#include "flashcomm/bindings.h"
#include "ipc_participant.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

using ipc::IpcParticipant;
using ipc::Region;

std::string Prefix(const char* op) { return std::string(op) + ": "; }

// A step between its start and its done.
struct Step {
  std::unique_ptr<IpcParticipant> me;
  cudaEvent_t arrived = nullptr;  // recorded on the link stream after the copy into recv
};

// The steps this process started and not yet finished, per call site, in start order (one
// device per process: a site has one replica group here).
class Steps {
 public:
  static Steps& Global() {
    static auto* steps = new Steps();  // never destroyed: handlers may run at exit
    return *steps;
  }
  void Push(int64_t site, Step step) {
    std::lock_guard<std::mutex> lock(mu_);
    steps_[site].push_back(std::move(step));
    ++count_;
  }
  bool Pop(int64_t site, Step* step) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = steps_.find(site);
    if (it == steps_.end() || it->second.empty()) return false;
    *step = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) steps_.erase(it);
    --count_;
    return true;
  }
  size_t Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::deque<Step>> steps_;
  size_t count_ = 0;
};

// This device's link stream (created once; non-blocking, so it never waits for the legacy
// default stream).
cudaError_t LinkStream(int device, cudaStream_t* out) {
  static std::mutex mu;
  static auto* streams = new std::map<int, cudaStream_t>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(device);
  if (it == streams->end()) {
    cudaStream_t s = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
      return e;
    }
    it = streams->emplace(device, s).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// `in` into `out` on `stream`, unless XLA aliased them.
cudaError_t PassThrough(cudaStream_t stream, const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (out.untyped_data() == in.untyped_data() || in.size_bytes() == 0) return cudaSuccess;
  return cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(),
                         cudaMemcpyDeviceToDevice, stream);
}

// The chunk of `sender` (mapped by the first barrier) into recv on the link stream, after this
// stream's work so far; `arrived` is recorded after it.
ffi::Error MoveChunk(const char* op, cudaStream_t stream, int device, const void* from,
                     void* recv, size_t bytes, cudaEvent_t* arrived) {
  cudaStream_t link = nullptr;
  FLASHCOMM_CUDA_TRY(op, "creating the link stream", LinkStream(device, &link));
  cudaEvent_t handoff = nullptr;
  FLASHCOMM_CUDA_TRY(op, "creating an event",
                     cudaEventCreateWithFlags(&handoff, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(handoff, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(link, handoff, 0);
  cudaEventDestroy(handoff);  // the enqueued wait does not need it
  FLASHCOMM_CUDA_TRY(op, "handing over to the link stream", err);
  if (bytes > 0) {
    FLASHCOMM_CUDA_TRY(op, "copying the peer's chunk",
                       cudaMemcpyAsync(recv, from, bytes, cudaMemcpyDefault, link));
  }
  FLASHCOMM_CUDA_TRY(op, "creating an event",
                     cudaEventCreateWithFlags(arrived, cudaEventDisableTiming));
  if (cudaError_t e = cudaEventRecord(*arrived, link); e != cudaSuccess) {
    cudaEventDestroy(*arrived);
    *arrived = nullptr;
    return CudaError(op, "recording the arrived event", e);
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ShmRingStart(cudaStream_t stream, ffi::AnyBuffer send, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> send_out,
                        ffi::Result<ffi::AnyBuffer> recv, ffi::Result<ffi::Buffer<ffi::S32>> order,
                        int64_t size, int64_t shift, int64_t site, int64_t timeout_ms,
                        int64_t link_bytes_per_s, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_ring_start";
  if (size < 1 || size > 1024 || (shift % size == 0 && size > 1)) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "size must be in 1..1024 and the shift "
                                       "must not send every chunk to itself");
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + p2p::TimeoutError(timeout_ms));
  }
  if (link_bytes_per_s != 0) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "link_bytes_per_s must be 0: link "
                                       "emulation is CPU only");
  }
  if (send_out->size_bytes() != send.size_bytes() || recv->size_bytes() != send.size_bytes() ||
      recv->element_type() != send.element_type()) {
    return ffi::Error::InvalidArgument(Prefix(kOp) +
                                       "recv and send_out must have send's size and dtype");
  }
  ffi::Error error = ffi::Error::Success();
  const shm::Api* api = ipc::BoundApi(kOp, &error);
  if (!api) return error;
  const auto deadline = p2p::DeadlineAfter(timeout_ms);
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  if (ffi::Error e = protocol::Start(kOp, stream, rank_buf, group_buf, size, deadline, &on,
                                     &device, &rank, &group);
      e.failure()) {
    return e;
  }
  FLASHCOMM_CUDA_TRY(kOp, "passing send through", PassThrough(stream, send, *send_out));
  FLASHCOMM_CUDA_TRY(kOp, "zeroing order",
                     cudaMemsetAsync(order->typed_data(), 0, sizeof(int32_t), stream));
  const size_t bytes = send.size_bytes();
  auto me = std::make_unique<IpcParticipant>(api, kOp, stream, deadline, site, group);
  if (ffi::Error e = me->Join(axes_key, rank, size, 2,
                              shm::Describe({5, int64_t(bytes), shift, size}), timeout_ms);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me->MeetRegions(0, {Region{send_out->untyped_data(), bytes}, Region{},
                                         Region{}});
      e.failure()) {
    return e;
  }
  const int sender = int(((rank - shift) % size + size) % size);
  Step step;
  if (ffi::Error e = MoveChunk(kOp, stream, device, me->peers()[sender][0],
                               recv->untyped_data(), bytes, &step.arrived);
      e.failure()) {
    return e;
  }
  step.me = std::move(me);
  Steps::Global().Push(site, std::move(step));
  return ffi::Error::Success();
}

ffi::Error ShmRingDone(cudaStream_t stream, ffi::AnyBuffer recv, ffi::AnyBuffer send,
                       ffi::AnyBuffer after, ffi::Buffer<ffi::S32> /*rank_buf*/,
                       ffi::Buffer<ffi::S32> /*group_buf*/, ffi::Result<ffi::AnyBuffer> recv_out,
                       ffi::Result<ffi::AnyBuffer> after_out, int64_t /*size*/,
                       int64_t /*shift*/, int64_t site, int64_t /*axes_key*/) {
  constexpr const char* kOp = "flashcomm_shm_ring_done";
  if (recv_out->size_bytes() != recv.size_bytes() ||
      after_out->size_bytes() != after.size_bytes() || send.size_bytes() != recv.size_bytes()) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "results must match recv and after");
  }
  Step step;
  if (!Steps::Global().Pop(site, &step)) {
    return ffi::Error::Internal(Prefix(kOp) + "this process has no step in progress at this "
                                "call site");
  }
  int device = 0;
  CurrentDevice on;
  FLASHCOMM_CUDA_TRY(kOp, "cudaStreamGetDevice", cudaStreamGetDevice(stream, &device));
  FLASHCOMM_CUDA_TRY(kOp, "cudaSetDevice", on.Set(device));
  const cudaError_t waited = cudaStreamWaitEvent(stream, step.arrived, 0);
  cudaEventDestroy(step.arrived);
  FLASHCOMM_CUDA_TRY(kOp, "waiting for the chunk", waited);
  FLASHCOMM_CUDA_TRY(kOp, "passing recv through", PassThrough(stream, recv, *recv_out));
  FLASHCOMM_CUDA_TRY(kOp, "passing after through", PassThrough(stream, after, *after_out));
  step.me->set_stream(stream);
  return step.me->MeetRegions(1, {});  // the last barrier; the participant then leaves
}

size_t ShmRingStepsInProgress() { return Steps::Global().Count(); }

}  // namespace cuda
}  // namespace flashcomm

// The bindings of the CPU handlers (flashcomm/bindings.h); the context adds the stream. No
// traits (see p2p_handlers.cc).
FLASHCOMM_DEFINE_CUDA_RING(Shm, flashcomm::bind::Peers::kShared,
                           ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>());
