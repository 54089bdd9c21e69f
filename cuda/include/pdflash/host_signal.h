// Host-to-stream signals: the GPU stream waits for a host job without the
// launching thread waiting (issue 16: "nothing waits on the host in the GPU
// stream except the final add").
//
// A ring of 32-bit flag words in page-locked host memory, mapped into the
// device's address space. One job takes a (slot, seq) ticket; the forward
// thread enqueues a one-thread kernel on its stream that polls the slot's
// flag, then the host-to-device copy of the job's output and the add; the
// host worker writes the output, then stores the flag (release) with the
// job's seq and its outcome (done or failed). The kernel stops on done,
// failed, or after a timeout, and in every case writes the slot's ack word
// (the slot may be reused from then on); failed and timed out also set the
// ring's sticky error words, which the host checks (never a silent add of an
// unwritten output: the engine raises at its next check).
//
// Flag word: (seq << 1) | failed, seq in [1, 2^31); 0 is never a job's seq,
// so a fresh slot is pending for every ticket. The protocol and the wait
// loop below are shared by the device kernel and the host stand-in
// (HostSignalRing::wait_host), which the CPU tests compare with the
// pure-Python reference pdflash/_reference/hostsignal.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define PDFLASH_HD __host__ __device__
#else
#define PDFLASH_HD
#endif

namespace pdflash {

enum class SignalState : std::uint32_t { kPending = 0, kDone = 1, kFailed = 2 };
// What a wait ended with (also the sticky error code: kFailed or kTimedOut).
enum class WaitOutcome : std::uint32_t { kNone = 0, kDone = 1, kFailed = 2, kTimedOut = 3 };

constexpr std::uint32_t kSignalSeqMask = 0x7fffffffu;

PDFLASH_HD inline std::uint32_t signal_value(std::uint32_t seq, bool failed) {
  return ((seq & kSignalSeqMask) << 1) | (failed ? 1u : 0u);
}

PDFLASH_HD inline SignalState signal_state(std::uint32_t value, std::uint32_t seq) {
  if ((value >> 1) != (seq & kSignalSeqMask)) return SignalState::kPending;
  return (value & 1u) ? SignalState::kFailed : SignalState::kDone;
}

// The seq after `seq` (1 .. 2^31 - 1, then 1 again; never 0).
PDFLASH_HD inline std::uint32_t next_signal_seq(std::uint32_t seq) {
  std::uint32_t n = (seq + 1u) & kSignalSeqMask;
  return n == 0u ? 1u : n;
}

// Poll until the flag carries `seq` (done or failed) or `timeout_ns` passed
// since the first poll. Env: load() (the flag word), now_ns(), pause().
// A flag that arrives with the deadline counts: every time check follows a
// load that found it pending.
template <class Env>
PDFLASH_HD WaitOutcome wait_signal(Env& env, std::uint32_t seq, std::uint64_t timeout_ns) {
  const std::uint64_t t0 = env.now_ns();
  for (;;) {
    SignalState s = signal_state(env.load(), seq);
    if (s == SignalState::kDone) return WaitOutcome::kDone;
    if (s == SignalState::kFailed) return WaitOutcome::kFailed;
    if (env.now_ns() - t0 >= timeout_ns) return WaitOutcome::kTimedOut;
    env.pause();
  }
}

struct SignalTicket {
  int slot = -1;
  std::uint32_t seq = 0;
};

// The ring (one per host service). acquire(), enqueue_wait() and unmap() come
// from one thread at a time (the forward's); signal() from any thread.
//
// Lifetime: freeing page-locked memory (cudaFreeHost) synchronizes the whole
// device. Freed while a device wait is pending (on this ring or another),
// it blocks until that wait ends; if the blocked thread is the one that
// would store the wait's flag (a host worker that dropped the ring's last
// reference), or holds a lock that one needs (Python's GIL), the wait runs
// into its timeout. So the owner calls unmap() at a known point, once no
// device wait runs (after synchronizing the device), and the destructor of
// an unmapped ring makes no CUDA call.
class HostSignalRing {
 public:
  // capacity >= 1 slots. mapped: page-locked and mapped into `device`
  // (CUDA builds with a device; throws otherwise), else plain host memory
  // (the host stand-in: wait_host only).
  HostSignalRing(int capacity, bool mapped, int device);
  ~HostSignalRing();
  HostSignalRing(const HostSignalRing&) = delete;
  HostSignalRing& operator=(const HostSignalRing&) = delete;

  // The next slot and a fresh seq. Throws std::runtime_error if the sticky
  // error is set, or if the slot's previous wait has not acknowledged within
  // reuse_wait_ns (its kernel never ran: the stream is stuck elsewhere).
  SignalTicket acquire(std::uint64_t reuse_wait_ns);
  // Store the job's outcome (release: the output written before is visible
  // to whoever sees the flag). Throws std::out_of_range on a bad slot.
  void signal(int slot, std::uint32_t seq, bool failed);
  // Move the words into plain host memory and free the page-locked ones now
  // (no device wait may still run). Every word keeps its value; later
  // stores land in the plain copy, where no device wait sees them;
  // enqueue_wait() throws from then on. Idempotent in effect (an unmapped
  // ring's words move to a fresh plain allocation).
  void unmap();
  // Enqueue the device wait for (slot, seq) on `stream` (a cudaStream_t of
  // `device`'s primary context). Throws std::runtime_error when not mapped
  // or the launch fails.
  void enqueue_wait(int slot, std::uint32_t seq, std::uintptr_t stream, std::uint64_t timeout_ns);
  // The device wait's loop and its ack/error writes, run on the calling CPU
  // thread (the host stand-in; tests).
  WaitOutcome wait_host(int slot, std::uint32_t seq, std::uint64_t timeout_ns);

  // Sticky error: kNone, or the first failed / timed-out wait and its seq.
  WaitOutcome error_code() const;
  std::uint32_t error_seq() const;
  std::uint32_t flag(int slot) const;
  std::uint32_t ack(int slot) const;
  int capacity() const { return capacity_; }
  bool mapped() const { return mapped_; }
  // Wait-kernel launches so far.
  std::uint64_t launches() const { return launches_; }

 private:
  void check_slot(int slot) const;
  std::size_t word_count() const { return 2 * std::size_t(capacity_) + 2; }

  int capacity_;
  bool mapped_;
  int device_;
  // words_: flags[capacity], acks[capacity], error_code, error_seq
  std::uint32_t* words_ = nullptr;
  std::uint32_t* dev_words_ = nullptr;  // the same words in the device's address space
  std::vector<std::uint32_t> last_seq_;  // the seq each slot was last given (0: never)
  std::uint32_t next_seq_ = 1;
  int next_slot_ = 0;
  std::uint64_t launches_ = 0;
  std::mutex mu_;
  // signal() (any thread) against unmap() swapping words_
  std::mutex store_mu_;
};

// True when this build has the device wait (PDFLASH_WITH_CUDA).
bool host_signal_has_cuda();

// Why the device wait cannot run on `device` ("" when it can): no CUDA in
// this build, no device, or a device without mapped host memory.
std::string host_signal_unavailable(int device);

}  // namespace pdflash
