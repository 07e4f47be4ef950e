// Ordering GPU work across processes without interprocess events (ipc_participant.h).
//   - Every process owns one block of 32-bit signal words in device memory (cudaMalloc,
//     exported once with cudaIpcGetMemHandle), one word per (site, group, barrier).
//   - A rank signals by enqueueing cuStreamWriteValue32(word, seq) on its stream: the write
//     follows the stream's earlier work, behind a memory fence.
//   - A peer maps the block once and enqueues cuStreamWaitValue32(word, seq, GEQ), a cyclic
//     (int32_t)(*word - seq) >= 0: later signals satisfy it too, and the counter may wrap.
// Interprocess events would order the same way, but the CUDA driver backs them with a file in
// /dev/shm (cuda.shm.0.<pid>.1) that stayed there after exit on an H200 even with every event
// destroyed, and always stays after a crash. Device memory shared by IPC handles leaves nothing.
// The driver's two functions come through cudaGetDriverEntryPointByVersion: the module links no
// libcuda, so it still loads where there is no driver. Plain C++ (host compiler).
#ifndef FLASHCOMM_CUDA_IPC_SIGNALS_H_
#define FLASHCOMM_CUDA_IPC_SIGNALS_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace flashcomm {
namespace cuda {
namespace ipc {

using Channel = std::tuple<int64_t, int64_t, int>;  // site, group, barrier

// cuStreamWriteValue32 and cuStreamWaitValue32 (the v2 memory operations of CUDA 11.7).
struct StreamMemOps {
  PFN_cuStreamWriteValue32_v11070 write = nullptr;
  PFN_cuStreamWaitValue32_v11070 wait = nullptr;
};

// The driver's stream memory operations, looked up once; null with `error` set when the driver
// has none.
inline const StreamMemOps* LoadStreamMemOps(std::string* error) {
  static StreamMemOps ops;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    auto lookup = [](const char* name, void** fn) {
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 11070, cudaEnableDefault,
                                                             &found);
      if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || *fn == nullptr) {
        failure = std::string("the CUDA driver has no ") + name + " (" +
                  (e != cudaSuccess ? cudaGetErrorString(e) : "symbol not found") + ")";
        return false;
      }
      return true;
    };
    void* write = nullptr;
    void* wait = nullptr;
    if (lookup("cuStreamWriteValue32", &write) && lookup("cuStreamWaitValue32", &wait)) {
      ops.write = reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(write);
      ops.wait = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(wait);
    }
  });
  if (!ops.write) {
    *error = failure;
    return nullptr;
  }
  return &ops;
}

// A driver call's failure in words.
inline std::string DriverErrorText(CUresult r) {
  return "CUresult " + std::to_string(int(r));
}

// This process's signal words: one device block, a word and a counter per channel. Guarded by
// the caller (IpcState's mutex).
class SignalBlock {
 public:
  static constexpr int kWords = 16384;  // 64 KiB: channels of every site, group and barrier

  // The block, allocated and zeroed on first use, and its IPC handle.
  cudaError_t Get(cudaStream_t stream, uint32_t** words, cudaIpcMemHandle_t* handle) {
    if (!words_) {
      void* p = nullptr;
      if (cudaError_t e = cudaMalloc(&p, kWords * sizeof(uint32_t)); e != cudaSuccess) return e;
      cudaError_t e = cudaMemsetAsync(p, 0, kWords * sizeof(uint32_t), stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);  // zero before a peer maps it
      if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle_, p);
      if (e != cudaSuccess) {
        cudaFree(p);
        return e;
      }
      words_ = static_cast<uint32_t*>(p);
    }
    *words = words_;
    *handle = handle_;
    return cudaSuccess;
  }

  // The next signal of `channel`: its word's index and the value to write. False when every
  // word is taken.
  bool Next(const Channel& channel, int64_t* word, uint32_t* seq) {
    auto it = channels_.find(channel);
    if (it == channels_.end()) {
      if (int(channels_.size()) >= kWords) return false;
      it = channels_.emplace(channel, State{int64_t(channels_.size()), 0}).first;
    }
    *word = it->second.word;
    *seq = ++it->second.seq;
    return true;
  }

  size_t channels() const { return channels_.size(); }

 private:
  struct State {
    int64_t word;
    uint32_t seq;
  };
  uint32_t* words_ = nullptr;
  cudaIpcMemHandle_t handle_{};
  std::map<Channel, State> channels_;
};

}  // namespace ipc
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_IPC_SIGNALS_H_
