// The shared-memory meeting point: the peer-to-peer transport when the ranks of a mesh axis are
// processes on one host, one device each (docs/transport.md, "Across processes").
//
// Every process owns a block (a memfd, never a name in /dev/shm) that its peers map through
// /proc/<pid>/fd/<fd>: the kernel lets only the same user (or a ptrace-capable one) open it,
// and it disappears with the last mapping, so a crash leaves nothing behind. Python exchanges
// the blocks' (pid, fd) once through jax.distributed's key-value store
// (jax_flashcomm/transport/shm.py). A block holds, per channel (a call site and replica group,
// hashed), a monotonic ticket (the barriers this rank has passed on the channel) and a record
// per barrier of the call in progress (the call's site, group and sequence number, a descriptor
// of its shapes and options, whether this rank failed, and where the regions it published lie).
// Published regions are copied into per-(channel, barrier) memfd segments that peers map on
// first use and again when the owner grows them.
//
// Arriving never blocks a thread, as in p2p_rendezvous.h: the rank copies its regions, bumps its
// ticket, rings its peers' doorbells (a futex word in each block) and leaves a continuation; one
// progress thread per process waits on its own doorbell (at most 10 ms, which also serves as the
// watchdog) and runs the continuations whose barrier has opened on the transport's workers.
// Calls of one channel run one after another in the order this process joined them (a site in a
// loop, many executions in flight); different channels run at once. Every wait is bounded by the
// call's timeout; a peer that exits fails the call at once; ranks whose descriptors differ all
// fail at the first barrier with an error that names them.
#ifndef FLASHCOMM_SHM_RENDEZVOUS_H_
#define FLASHCOMM_SHM_RENDEZVOUS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "flashcomm/p2p_rendezvous.h"

namespace flashcomm {
namespace shm {

// One region a rank publishes at a barrier (copied into its shared segment).
struct Span {
  const void* data = nullptr;
  size_t bytes = 0;
};
using Spans = std::array<Span, 4>;

// A block's address for its peers.
struct BlockId {
  int64_t process_index = -1;
  int64_t pid = 0;
  int64_t fd = -1;
};

// Creates this process's block (once; later calls return the same id).
bool CreateBlock(int64_t process_index, BlockId* id, std::string* error);
// Maps the peers' blocks (every process of the job on this host, this one included).
bool AttachBlocks(const std::vector<BlockId>& blocks, std::string* error);
// Processes whose blocks are mapped (0 before AttachBlocks).
int AttachedProcesses();

struct Meeting;  // one call of this process's rank

// A call's descriptor (JoinArgs::descriptor): FNV-1a over the values that every rank of the
// call must agree on (its shapes and options).
inline uint64_t Describe(std::initializer_list<int64_t> values) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t v : values) {
    for (int i = 0; i < 8; ++i) {
      h ^= uint64_t(v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  return h;
}

struct JoinArgs {
  int64_t axes_key;     // the mesh axes (a hash of their names)
  int64_t site;         // the call site
  int64_t group;        // the replica group
  int rank;             // this process's rank in the group
  int size;             // ranks in the group
  int barriers;         // barriers of the protocol (the last one only guards buffer lifetime)
  uint64_t descriptor;  // the call's shapes and options: every rank's must be equal
  int64_t timeout_ms;   // bounds each wait, from the moment the call owns its channel
};

// Joins this rank's next call of (site, group); nullptr and `error` when it cannot.
std::shared_ptr<Meeting> Join(const JoinArgs& args, std::string* error);
// Publishes `mine` at `barrier` (failed: this rank's own work failed, its peers fail too);
// `then` runs once every rank has arrived, with every rank's region pointers (a failed rank's
// entry [3] is &p2p::kRankFailed), or with the error that ended the call. Never waits for a
// peer; with an emulated link (SetLinkRate) it first holds the link for `wire_bytes`, the bytes
// of `mine` its peers will read.
void Arrive(const std::shared_ptr<Meeting>& meeting, int barrier, const Spans& mine, bool failed,
            p2p::Continuation then, int64_t wire_bytes = 0);
// Ends the call for every rank now (this rank cannot go on): peers fail at their next barrier.
void Abort(const std::shared_ptr<Meeting>& meeting, const std::string& why);
// Done with the call (after its last barrier or an error); the channel's next call may start.
void Leave(const std::shared_ptr<Meeting>& meeting);
// Emulates a link of `bytes_per_s` shared by every rank of the host (one bus: a PCIe host
// bridge), for benchmarks: every publication holds the bus for its wire bytes, in turn with the
// other processes' (a reservation in the lowest process's block). 0: no emulation (default).
void SetLinkRate(double bytes_per_s);
double LinkRate();
// Holds the emulated bus for `bytes` (returns when they would have crossed it); at once when no
// link is emulated.
void Pace(int64_t bytes);
// Reserves the emulated bus for `bytes` from now (after the reservations before it) without
// waiting: the steady-clock time, in ns since its epoch, at which they will have crossed it (0
// when no link is emulated). Pace is ReserveBus, then a sleep until that time.
int64_t ReserveBus(int64_t bytes);
// Calls joined and not left (0 between collectives).
size_t InProgress();
// Publishes a description of call site `site` (Python's, at trace time) in this process's
// block: peers' errors name the call this process is at by it. Up to 1024 sites; later ones
// stay unnamed (errors give their id).
void NameSite(int64_t site, const std::string& text);
// Shared segments this process owns or maps (blocks excluded): for tests.
size_t SegmentsMapped();

// The meeting point for another extension module of this process (the CUDA module's handlers,
// ffi/cuda/shm_handlers.cc): it must meet through this module's engine, not a copy of its own,
// so the CPU module hands out these entry points in a capsule (its shm_api()). Both modules are
// built by one CMake project with one compiler, so the std:: types in them agree.
struct Api {
  uint32_t version;  // kApiVersion
  std::shared_ptr<Meeting> (*join)(const JoinArgs& args, std::string* error);
  void (*arrive)(const std::shared_ptr<Meeting>& meeting, int barrier, const Spans& mine,
                 bool failed, p2p::Continuation then, int64_t wire_bytes);
  void (*abort)(const std::shared_ptr<Meeting>& meeting, const std::string& why);
  void (*leave)(const std::shared_ptr<Meeting>& meeting);
  int (*attached_processes)();
  // Published[3] of a failed rank: this module's p2p::kRankFailed (an inline variable has one
  // address per shared object).
  const void* rank_failed;
};
constexpr uint32_t kApiVersion = 1;
// This module's entry points (static storage).
const Api* GetApi();

}  // namespace shm
}  // namespace flashcomm

#endif  // FLASHCOMM_SHM_RENDEZVOUS_H_
