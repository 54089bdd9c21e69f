// pdflash H2D issuer: host-to-device copies in named priority bands,
// enforced in software on ONE copy stream.
//
// Why software: on the H200, CUDA stream priority does not reorder copies
// (docs/design.md §3): the copy engine serves whatever is already queued. So the
// issuer keeps only a small window of bytes in flight and picks the next chunk
// by band (ON_DEMAND > ROUTE_AHEAD > BACKGROUND), FIFO within a band. Large
// copies are split into chunks, so an ON_DEMAND copy waits about one window.
//
// Tickets are opaque int64s; each keeps one state byte for the issuer's
// lifetime (poll/wait work on any ticket ever issued), failed ones also their
// error text. Live copies are limited to 2^24.
//
// Threading: every public method is thread-safe. One worker thread per issuer
// keeps the window full (event-driven; no Python involved); submit() only
// enqueues. Never includes or knows PyTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pdflash {

constexpr int kNumBands = 3;
enum BandId : int { kOnDemand = 0, kRouteAhead = 1, kBackground = 2 };

// Key value that never deduplicates (-1 as int64).
constexpr std::uint64_t kNoKey = ~std::uint64_t(0);

struct IssuerConfig {
  bool use_cuda = false;      // CUDA backend (else host backend)
  int device = 0;             // CUDA device ordinal
  // Defaults: the smallest chunks that still run the link near its peak, and a
  // 2-chunk window, so an on-demand copy waits behind at most one chunk while
  // the background keeps the link busy (chosen by `pdflash-bench h2d --sweep`
  // on the H200; bench/results/h200/README.md). Copies are split into
  // ceil(bytes / chunk_bytes) equal chunks.
  std::size_t chunk_bytes = std::size_t(8) << 20;
  std::size_t window_bytes = std::size_t(16) << 20;  // bytes in flight
  int max_inflight_chunks = 32;  // bounds the window for tiny copies
  // Just-in-time issue (0: off). With a window of two chunks, one whole chunk
  // sits queued behind the running one, and an urgent copy arriving now waits
  // for both. With a lead L > 0, one more chunk is queued only when the
  // in-flight ones are estimated (link rate measured from finished chunks)
  // to drain within L seconds: the choice of the next chunk is made as late
  // as possible while the copy engine is still never left idle. L must exceed
  // the worker's reaction time (a few microseconds on CUDA). The Python
  // layer (pdflash.h2d.H2DIssuer) defaults to 20 us on CUDA.
  double issue_lead_s = 0.0;
  double emulated_link_gbps = 0.0;  // host backend only; <= 0: memcpy speed
  bool debug_log = false;  // record every queue/start/end event (tests)
};

// Ticket states.
enum TicketState : std::uint8_t {
  kQueued = 0,     // no chunk started yet
  kRunning = 1,    // some chunks started
  kDone = 2,
  kFailed = 3,
  kCancelled = 4,
};

// Debug log event kinds (recorded under the issuer lock: one total order).
enum LogKind : std::int32_t {
  kLogSubmit = 0,   // ticket queued: band, bytes=total bytes, chunk=n_chunks
  kLogPromote = 1,  // ticket moved to a higher band: band = new band
  kLogCancel = 2,   // ticket cancelled before any chunk started
  kLogStart = 3,    // chunk started: band, chunk index, bytes
  kLogEnd = 4,      // chunk finished: ok = success
  kLogFinish = 5,   // ticket terminal: ok = done (else failed)
};

struct LogEvent {
  double t_s;            // seconds since the issuer started
  std::int32_t kind;
  std::int32_t band;
  std::int64_t ticket;
  std::int64_t chunk;
  std::int64_t bytes;
  std::int32_t ok;
};

struct BandStats {
  std::uint64_t copies;         // completed successfully
  std::uint64_t bytes;          // bytes of completed copies
  std::uint64_t submitted;      // new copies queued in this band
  std::uint64_t dedup_hits;     // submits answered by an already-live copy
  std::uint64_t promotions;     // copies promoted INTO this band
  std::uint64_t cancellations;
  std::uint64_t failures;
  double blocked_wait_s;        // time callers spent blocked in wait/stream_wait
  std::uint64_t delay_samples;  // queue-delay samples in the quantile window
  double queue_delay_p50_s;     // submit -> first chunk start (last 65536 copies)
  double queue_delay_p99_s;
};

struct IssuerStats {
  BandStats bands[kNumBands];
  double link_busy_s;       // summed copy time of all chunks on the link
  double uptime_s;
  std::uint64_t chunks;     // chunks completed (ok or not)
  std::uint64_t queued_copies;
  std::uint64_t queued_bytes;   // bytes of live copies not yet issued
  std::uint64_t inflight_chunks;
  std::uint64_t inflight_bytes;
  double link_rate_estimate_bps;  // EWMA over finished chunks (0: none yet)
  // submit() calls that took the lock, and their cumulative time waiting
  // for it and holding it (the issue-cost breakdown).
  std::uint64_t submit_calls;
  double submit_lock_wait_s;
  double submit_locked_s;
};

// The link's state now, without the quantiles of stats(): cheap enough to
// read every engine step (stats() copies and sorts each band's queue-delay
// window, up to 65536 samples a band).
struct LinkState {
  std::uint64_t queued_copies;
  std::uint64_t inflight_chunks;
  double link_rate_estimate_bps;  // EWMA over finished chunks (0: none yet)
};

enum WaitCode : int { kWaitOk = 0, kWaitTimeout = 1, kWaitFailed = 2, kWaitCancelled = 3 };

struct WaitResult {
  int code = kWaitOk;
  std::int64_t ticket = -1;  // the offending ticket (failed/cancelled/timed out)
  std::string message;
};

class Issuer {
 public:
  // Throws std::invalid_argument on a bad config, std::runtime_error when
  // the backend cannot start.
  explicit Issuer(const IssuerConfig& config);
  ~Issuer();  // shutdown() then free
  Issuer(const Issuer&) = delete;
  Issuer& operator=(const Issuer&) = delete;

  const char* backend_name() const;
  // The worker thread's kernel id (Linux, once it has started; else 0), for
  // placing it on cores.
  std::int64_t worker_tid() const;
  const IssuerConfig& config() const;

  // Queue n copies in `band`. A key already live (queued or running) is not
  // copied twice: its ticket is returned, and a more urgent band promotes its
  // not-yet-started chunks. Throws std::invalid_argument (naming the bad
  // index/value) and leaves the issuer unchanged on: bytes <= 0, a band out of
  // range, a source range [src, src + bytes) not inside one source region or
  // a destination range not inside one destination region (see below), a live
  // key resubmitted with different src/dst/bytes. Throws std::runtime_error
  // after shutdown(). Nothing of a rejected batch is queued.
  // Copy i is nbytes[i * nbytes_stride] bytes (stride 0: all the same size).
  void submit(const std::int64_t* src, const std::int64_t* dst, const std::int64_t* nbytes,
              std::size_t nbytes_stride, const std::uint64_t* keys, std::size_t n, int band,
              std::int64_t* tickets_out);

  // Ticket states into out[i]; throws std::invalid_argument on an unknown ticket.
  void states(const std::int64_t* tickets, std::size_t n, std::uint8_t* out) const;

  // Block until every ticket is terminal (timeout_s < 0: forever).
  WaitResult wait(const std::int64_t* tickets, std::size_t n, double timeout_s);

  // CUDA: `stream` waits (device side) for the tickets' last chunks; blocks
  // the host only until those chunks have been issued. Host: like wait().
  WaitResult stream_wait(const std::int64_t* tickets, std::size_t n, std::uintptr_t stream,
                         double timeout_s);

  // Cancel copies with no chunk started, in `band` (or all when band < 0).
  // Returns how many. The issuer stays usable.
  std::int64_t cancel(int band);

  // Cancel each ticket's copy if none of its chunks has started: out[i] = 1
  // where it was cancelled now, 0 where it had started or finished (it then
  // runs to its end as before). Throws std::invalid_argument on an unknown
  // ticket, before cancelling any.
  void cancel_unstarted(const std::int64_t* tickets, std::size_t n, std::uint8_t* out);

  IssuerStats stats() const;
  LinkState link_state() const;
  std::vector<LogEvent> debug_log() const;

  // Memory the issuer may touch. NOTE: the issuer never reads or writes
  // outside the regions it was given: an unknown pointer would crash the
  // worker (SIGSEGV on the host backend) or, past the end of a buffer, copy
  // whatever lies beyond it. A copy must lie inside ONE region on each side
  // (not across two adjacent ones: releasing one must find every copy that
  // touches it). Regions may overlap or repeat.
  //
  // Source region (pinned host memory). check_pinned: ask the backend first
  // (CUDA: both ends must be page-locked host memory; the host backend
  // accepts everything); false for memory the caller pinned itself
  // (alloc_pinned, register_host). Throws std::invalid_argument on an empty
  // or wrapping range, or memory the backend refuses.
  void add_source_region(std::uintptr_t begin, std::size_t n, bool check_pinned);
  // Destination region (CUDA: device memory, checked at both ends; host
  // backend: any host memory the caller owns). Same errors.
  void add_destination_region(std::uintptr_t begin, std::size_t n, bool check_device);
  // Before [begin, begin + n) is freed or unregistered: cancels the copies
  // from or into it that have not started, blocks until the started ones
  // finish, and forgets every source and destination region that begins
  // inside it. Returns how many were cancelled.
  std::int64_t release_region(std::uintptr_t begin, std::size_t n);
  // Undo one add_*_region(begin, n) (other registrations stay): copies from
  // (source) or into (destination) [begin, begin + n) that have not started
  // are cancelled, started ones waited for. Throws std::invalid_argument when
  // no such registration exists. Returns how many were cancelled.
  std::int64_t remove_source_region(std::uintptr_t begin, std::size_t n);
  std::int64_t remove_destination_region(std::uintptr_t begin, std::size_t n);

  // Host-backend test hooks; return false on the CUDA backend.
  bool test_hold_link(bool hold);
  bool test_inject_failures(int count, const std::string& text);

  // Stop the worker: queued copies are cancelled, in-flight chunks drained,
  // stream/events/threads freed. Idempotent; later submits throw.
  void shutdown();
  bool closed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdflash
