// long file: the CUDA IPC participant: its handles, mapped buffers, events and signal words are one
// class and its helpers
// The CUDA IPC side of the transport between processes (docs/cuda.md, "Across processes: CUDA
// IPC"), shared by the collectives (shm_handlers.cc) and the ring steps (shm_ring_handlers.cc):
// the staging buffers and signal words of this process, the peers' mapped handles, and
// the participant of one call, which meets its peers through the CPU module's shared-memory
// meeting point (cpu/shm_rendezvous.h, bound once from Python).
//   - A rank copies what it publishes at a barrier into a staging buffer of its own, allocated
//     with cudaMalloc (legacy IPC exports only those; XLA's allocator may hand out memory it
//     cannot), one per (site, group, barrier), grown by doubling.
//   - After the copy it signals on its stream (ipc_signals.h: a 32-bit word in device memory,
//     one per site, group and barrier, written by the stream), and publishes the buffer's and
//     the signal block's IPC handles, its offsets, the word and the value.
//   - A peer maps each handle once (cached by process and id), makes its stream wait for the
//     word, and copies from the mapped buffer. The last barrier orders the reuse of a staging
//     buffer after every peer's reads.
// The stream waits have no timeout of their own: a peer that has passed a barrier has
// enqueued its signal, so only a peer whose GPU work fails or is lost after that (a crash, a
// failed kernel) leaves them waiting.
// Host waits are bounded by timeout_ms (the meeting point's watchdog); a peer that exits fails
// the call at once. Plain C++ (host compiler, CUDA runtime API).
#ifndef FLASHCOMM_CUDA_IPC_PARTICIPANT_H_
#define FLASHCOMM_CUDA_IPC_PARTICIPANT_H_

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "flashcomm/p2p_rendezvous.h"
#include "cpu/shm_rendezvous.h"
#include "ipc_signals.h"
#include "p2p_host.h"
#include "p2p_protocol.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {
namespace ipc {

namespace ffi = xla::ffi;
using Clock = std::chrono::steady_clock;
using p2p::Published;
using protocol::AlignUp;

// The CPU module's meeting point (shm_bind); null until Python binds it.
inline std::atomic<const shm::Api*> g_api{nullptr};

// What a rank publishes at one barrier (copied by the meeting point into its shared segment).
// The meeting point carries no data at a protocol's last barrier (it only orders buffer reuse),
// so the last barrier's signal (word and value) travels ahead, in the first barrier's slot.
struct IpcSlot {
  cudaIpcMemHandle_t mem;      // its staging buffer (buffer_id > 0)
  cudaIpcMemHandle_t signals;  // its signal block (the same for every call of a process)
  int64_t pid;
  int64_t buffer_id;   // 0: nothing published at this barrier
  int64_t word;        // written with `seq` after the staging copy
  int64_t seq;
  int64_t final_word;  // written with `final_seq` at the last barrier (done reading the peers)
  int64_t final_seq;
  int64_t offset[3];
};

// Process-wide: this process's staging buffers and signal words, and the peers' mapped handles.
// One GPU per process (the Python side checks); every member under mu_.
class IpcState {
 public:
  static IpcState& Global() {
    static auto* state = new IpcState();  // never destroyed: handlers may run at exit
    return *state;
  }

  // This process's staging buffer of `channel`, holding at least `bytes`.
  cudaError_t Staging(const Channel& channel, size_t bytes, void** ptr, int64_t* id,
                      cudaIpcMemHandle_t* handle) {
    std::lock_guard<std::mutex> lock(mu_);
    Buffer& b = staging_[channel];
    if (b.bytes < bytes) {
      // cudaFree (in GrowDeviceBlock) waits for the device: this stream's earlier waits for
      // the peers' last signals (every peer done reading the old buffer) come first.
      if (cudaError_t e = GrowDeviceBlock(bytes, size_t(1) << 20, &b.ptr, &b.bytes);
          e != cudaSuccess) {
        return e;
      }
      if (cudaError_t e = cudaIpcGetMemHandle(&b.handle, b.ptr); e != cudaSuccess) {
        cudaFree(b.ptr);
        b = Buffer{};
        return e;
      }
      b.id = ++next_id_;
    }
    *ptr = b.ptr;
    *id = b.id;
    *handle = b.handle;
    return cudaSuccess;
  }

  // The next signal of `channel` on this process's block: its word, the value, and the
  // block's IPC handle; `ptr` is the word's address here.
  ffi::Error Signal(const char* op, const Channel& channel, cudaStream_t stream, int64_t* word,
                    uint32_t* seq, cudaIpcMemHandle_t* handle, CUdeviceptr* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t* words = nullptr;
    FLASHCOMM_CUDA_TRY(op, "allocating the IPC signal block",
                       signals_.Get(stream, &words, handle));
    if (!signals_.Next(channel, word, seq)) {
      return ffi::Error::Internal(std::string(op) + ": every one of the " +
                                  std::to_string(SignalBlock::kWords) +
                                  " IPC signal words is taken (too many call sites)");
    }
    *ptr = reinterpret_cast<CUdeviceptr>(words + *word);
    return ffi::Error::Success();
  }

  // Peer `pid`'s staging buffer `id` of `channel`, mapped here. A new id replaces the mapping
  // of the previous one, after `stream` (whose earlier copies read it) has drained.
  cudaError_t PeerBuffer(int64_t pid, const Channel& channel, int64_t id,
                         const cudaIpcMemHandle_t& handle, cudaStream_t stream,
                         Clock::time_point deadline, void** ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    Mapping& m = mapped_[{pid, channel}];
    if (m.id != id) {
      if (m.ptr) {
        if (cudaError_t e = Drain(stream, deadline); e != cudaSuccess) return e;
        cudaIpcCloseMemHandle(m.ptr);
        m = Mapping{};
      }
      if (cudaError_t e = cudaIpcOpenMemHandle(&m.ptr, handle, cudaIpcMemLazyEnablePeerAccess);
          e != cudaSuccess) {
        m = Mapping{};
        return e;
      }
      m.id = id;
    }
    *ptr = m.ptr;
    return cudaSuccess;
  }

  // Peer `pid`'s signal block, mapped here (once per process: it lives as long as its owner).
  cudaError_t PeerSignals(int64_t pid, const cudaIpcMemHandle_t& handle, const uint32_t** words) {
    std::lock_guard<std::mutex> lock(mu_);
    void*& m = peer_signals_[pid];
    if (!m) {
      if (cudaError_t e = cudaIpcOpenMemHandle(&m, handle, cudaIpcMemLazyEnablePeerAccess);
          e != cudaSuccess) {
        peer_signals_.erase(pid);
        return e;
      }
    }
    *words = static_cast<const uint32_t*>(m);
    return cudaSuccess;
  }

  // Signal words this process has given to channels (for tests).
  size_t SignalChannels() {
    std::lock_guard<std::mutex> lock(mu_);
    return signals_.channels();
  }

  // Peers' staging buffers mapped in this process (for tests).
  size_t Mapped() {
    std::lock_guard<std::mutex> lock(mu_);
    return mapped_.size();
  }

 private:
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    int64_t id = 0;
    cudaIpcMemHandle_t handle{};
  };
  struct Mapping {
    int64_t id = 0;
    void* ptr = nullptr;
  };

  // `stream`'s work done, polled until `deadline`.
  static cudaError_t Drain(cudaStream_t stream, Clock::time_point deadline) {
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q != cudaErrorNotReady) return q;
      if (Clock::now() >= deadline) return cudaErrorNotReady;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::mutex mu_;
  int64_t next_id_ = 0;
  std::map<Channel, Buffer> staging_;
  SignalBlock signals_;
  std::map<std::pair<int64_t, Channel>, Mapping> mapped_;
  std::map<int64_t, void*> peer_signals_;
};

// One region a rank publishes (device memory).
struct Region {
  const void* data = nullptr;
  size_t bytes = 0;
};

// One rank's part in one call over IPC: the Participant of p2p_protocol.h. Record() is a no-op:
// Meet() signals after its staging copy, so that the peers' wait covers it (and everything this
// stream did before).
class IpcParticipant {
 public:
  IpcParticipant(const shm::Api* api, const char* op, cudaStream_t stream,
                 Clock::time_point deadline, int64_t site, int64_t group)
      : api_(api), op_(op), stream_(stream), deadline_(deadline), site_(site), group_(group) {}
  IpcParticipant(const IpcParticipant&) = delete;
  IpcParticipant& operator=(const IpcParticipant&) = delete;
  // A call that did not pass its last barrier (this rank failed: a CUDA error, a bad slot)
  // ends the meeting for every rank, so that its peers fail now rather than at their timeout.
  ~IpcParticipant() {
    if (!meeting_) return;
    if (!finished_) {
      api_->abort(meeting_, std::string(op_) + ": rank " + std::to_string(rank_) +
                                " failed in this call");
    }
    api_->leave(meeting_);
  }

  ffi::Error Join(int64_t axes_key, int32_t rank, int64_t size, int barriers,
                  uint64_t descriptor, int64_t timeout_ms) {
    rank_ = rank;
    size_ = int(size);
    barriers_ = barriers;
    std::string error;
    meeting_ = api_->join({axes_key, site_, group_, rank, int(size), barriers, descriptor,
                           timeout_ms},
                          &error);
    if (!meeting_) return ffi::Error::Internal(std::string(op_) + ": " + error);
    peers_.assign(size_, Published{});
    return ffi::Error::Success();
  }

  ffi::Error Record() { return ffi::Error::Success(); }

  ffi::Error Meet(int barrier, const void* codes, const void* scale, const void* zero,
                  int64_t groups, int64_t nb) {
    return MeetRegions(barrier, {Region{codes, size_t(groups * nb)},
                                 Region{scale, size_t(groups) * 2},
                                 Region{zero, size_t(groups) * 2}});
  }

  // Publishes up to three regions of device memory at `barrier` (staged), waits for every
  // rank, then orders this stream after each peer's staging copy; peers() then points into
  // their mapped staging buffers. At the last barrier (no regions) it orders this stream after
  // every peer's reads of this rank's buffers.
  ffi::Error MeetRegions(int barrier, const std::array<Region, 3>& regions) {
    IpcSlot slot;
    std::memset(&slot, 0, sizeof slot);
    slot.pid = int64_t(getpid());
    IpcState& state = IpcState::Global();
    const Channel channel{site_, group_, barrier};
    const bool last = barrier + 1 == barriers_;
    if (last) return MeetLast(state, channel);
    if (barrier == 0) {  // the first slot carries the last barrier's word and value
      uint32_t seq = 0;
      if (ffi::Error e = state.Signal(op_, Channel{site_, group_, barriers_ - 1}, stream_,
                                      &slot.final_word, &seq, &slot.signals, &final_ptr_);
          e.failure()) {
        return e;
      }
      slot.final_seq = final_seq_ = seq;
    }
    size_t total = 0;
    for (const Region& r : regions) total += AlignUp(r.bytes);
    if (total > 0) {
      void* base = nullptr;
      FLASHCOMM_CUDA_TRY(op_, "allocating the IPC staging buffer",
                         state.Staging(channel, total, &base, &slot.buffer_id, &slot.mem));
      size_t at = 0;
      for (int i = 0; i < 3; ++i) {
        slot.offset[i] = int64_t(at);
        if (regions[i].bytes == 0) continue;
        FLASHCOMM_CUDA_TRY(op_, "staging a published region",
                           cudaMemcpyAsync(static_cast<uint8_t*>(base) + at, regions[i].data,
                                           regions[i].bytes, cudaMemcpyDeviceToDevice,
                                           stream_));
        at += AlignUp(regions[i].bytes);
      }
    }
    uint32_t seq = 0;
    CUdeviceptr word = 0;
    if (ffi::Error e = state.Signal(op_, channel, stream_, &slot.word, &seq, &slot.signals, &word);
        e.failure()) {
      return e;
    }
    slot.seq = seq;
    if (ffi::Error e = WriteSignal(word, seq); e.failure()) return e;

    std::shared_ptr<Wait> wait;
    if (ffi::Error e = Arrive(barrier, shm::Spans{shm::Span{&slot, sizeof slot}}, true, &wait);
        e.failure()) {
      return e;
    }
    if (barrier == 0) final_signals_ = wait->slots;  // their last barrier's words and values
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) {
        peers_[j] = Published{regions[0].data, regions[1].data, regions[2].data, nullptr};
        continue;
      }
      const IpcSlot& peer = wait->slots[j];
      if (ffi::Error e = WaitSignal(state, peer, peer.word, peer.seq); e.failure()) return e;
      peers_[j] = Published{};
      if (peer.buffer_id == 0) continue;
      void* base = nullptr;
      FLASHCOMM_CUDA_TRY(op_, "opening a peer's IPC memory",
                         state.PeerBuffer(peer.pid, channel, peer.buffer_id, peer.mem, stream_,
                                          deadline_, &base));
      auto* b = static_cast<const uint8_t*>(base);
      peers_[j] = Published{b + peer.offset[0], b + peer.offset[1], b + peer.offset[2], nullptr};
    }
    return ffi::Error::Success();
  }

  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
    std::vector<IpcSlot> slots;
    std::vector<bool> failed;
  };

  // Arrives at `barrier` with `spans` and waits (bounded) until every rank has; with `slots`,
  // every rank's published IpcSlot is copied out (a rank that published none counts as failed).
  // An error when the meeting failed or a rank did.
  ffi::Error Arrive(int barrier, const shm::Spans& spans, bool slots,
                    std::shared_ptr<Wait>* out) {
    auto wait = std::make_shared<Wait>();
    const void* failed_mark = api_->rank_failed;
    const int size = size_;
    api_->arrive(
        meeting_, barrier, spans, false,
        [wait, failed_mark, size, slots](const std::vector<Published>& peers,
                                         const std::string& error) {
          std::lock_guard<std::mutex> lock(wait->mu);
          wait->error = error;
          if (error.empty()) {
            wait->slots.resize(size);
            wait->failed.assign(size, false);
            for (int j = 0; j < size && j < int(peers.size()); ++j) {
              if (peers[j][3] == failed_mark || (slots && peers[j][0] == nullptr)) {
                wait->failed[j] = true;
              } else if (slots) {
                std::memcpy(&wait->slots[j], peers[j][0], sizeof(IpcSlot));
              }
            }
          }
          wait->done = true;
          wait->cv.notify_all();
        },
        0);
    {
      // The meeting point's watchdog answers by the deadline; the margin only guards against a
      // meeting point that never calls back.
      std::unique_lock<std::mutex> lock(wait->mu);
      if (!wait->cv.wait_until(lock, deadline_ + std::chrono::seconds(10),
                               [&] { return wait->done; })) {
        return ffi::Error::Internal(std::string(op_) + ": the meeting point did not answer");
      }
    }
    if (!wait->error.empty()) return ffi::Error::Internal(std::string(op_) + ": " + wait->error);
    for (int j = 0; j < size_; ++j) {
      if (wait->failed[j]) {
        return ffi::Error::Internal(std::string(op_) + ": rank " + std::to_string(j) +
                                    " failed in this call");
      }
    }
    *out = std::move(wait);
    return ffi::Error::Success();
  }

  // The last barrier: signal that this rank is done reading its peers, meet, then wait for
  // every peer's signal (their words and values came with the first barrier's slots).
  ffi::Error MeetLast(IpcState& state, const Channel& channel) {
    if (int(final_signals_.size()) != size_) {
      return ffi::Error::Internal(std::string(op_) + ": the last barrier came first");
    }
    if (ffi::Error e = WriteSignal(final_ptr_, final_seq_); e.failure()) return e;
    std::shared_ptr<Wait> wait;
    if (ffi::Error e = Arrive(std::get<2>(channel), shm::Spans{}, false, &wait); e.failure()) {
      return e;
    }
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      const IpcSlot& peer = final_signals_[j];
      if (ffi::Error e = WaitSignal(state, peer, peer.final_word, peer.final_seq); e.failure()) {
        return e;
      }
    }
    finished_ = true;
    return ffi::Error::Success();
  }

  // Enqueues this rank's signal: `word` takes `seq` once the stream's earlier work is done.
  ffi::Error WriteSignal(CUdeviceptr word, uint32_t seq) {
    std::string error;
    const StreamMemOps* ops = LoadStreamMemOps(&error);
    if (!ops) return ffi::Error::Internal(std::string(op_) + ": " + error);
    if (CUresult r = ops->write(reinterpret_cast<CUstream>(stream_), word, seq,
                                CU_STREAM_WRITE_VALUE_DEFAULT);
        r != CUDA_SUCCESS) {
      return ffi::Error::Internal(std::string(op_) + ": cuStreamWriteValue32 failed, " +
                                  DriverErrorText(r));
    }
    return ffi::Error::Success();
  }

  // Makes this stream wait until `peer`'s `word` has reached `seq` (a cyclic >=).
  ffi::Error WaitSignal(IpcState& state, const IpcSlot& peer, int64_t word, int64_t seq) {
    if (word < 0 || word >= SignalBlock::kWords) {
      return ffi::Error::Internal(std::string(op_) + ": a peer's signal word is out of range");
    }
    const uint32_t* words = nullptr;
    FLASHCOMM_CUDA_TRY(op_, "mapping a peer's IPC signal block",
                       state.PeerSignals(peer.pid, peer.signals, &words));
    std::string error;
    const StreamMemOps* ops = LoadStreamMemOps(&error);
    if (!ops) return ffi::Error::Internal(std::string(op_) + ": " + error);
    if (CUresult r = ops->wait(reinterpret_cast<CUstream>(stream_),
                               reinterpret_cast<CUdeviceptr>(words + word), uint32_t(seq),
                               CU_STREAM_WAIT_VALUE_GEQ);
        r != CUDA_SUCCESS) {
      return ffi::Error::Internal(std::string(op_) + ": cuStreamWaitValue32 failed, " +
                                  DriverErrorText(r));
    }
    return ffi::Error::Success();
  }

  const std::vector<Published>& peers() const { return peers_; }
  int size() const { return size_; }
  // The stream of this rank's later barriers (a ring step's done runs on its own call's).
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  // A peer's mapped memory (or this rank's own) into this device's (UVA: one copy kind).
  cudaError_t Copy(cudaStream_t stream, void* dst, int /*j*/, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
  }
  ffi::Error Prepare() { return ffi::Error::Success(); }  // IPC mappings enable peer access

 private:
  const shm::Api* api_;
  const char* op_;
  cudaStream_t stream_;
  Clock::time_point deadline_;
  int64_t site_, group_;
  int rank_ = 0;
  int size_ = 1;
  int barriers_ = 0;
  std::shared_ptr<shm::Meeting> meeting_;
  std::vector<Published> peers_;
  std::vector<IpcSlot> final_signals_;  // every rank's first slot (their last signals)
  CUdeviceptr final_ptr_ = 0;           // this rank's last-barrier word and value
  uint32_t final_seq_ = 0;
  bool finished_ = false;  // passed the last barrier
};

inline const shm::Api* BoundApi(const char* op, ffi::Error* error) {
  const shm::Api* api = g_api.load(std::memory_order_acquire);
  if (!api) {
    *error = ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(op) + ": the shared-memory meeting point is not bound to the CUDA module "
        "(jax_flashcomm.transport.shm.setup() binds it)");
  }
  return api;
}

}  // namespace ipc
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_IPC_PARTICIPANT_H_
