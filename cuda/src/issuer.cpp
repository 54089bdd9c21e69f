// The issuer core: per-band FIFO queues of copies, dedup by key, promotion,
// cancel, tickets, stats, and the worker thread that keeps the window full.
#include "pdflash/issuer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>

#include "pdflash/copy_backend.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA && defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define PDFLASH_NVTX 1
#endif
#endif

namespace pdflash {
namespace {

#ifdef PDFLASH_NVTX
struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
};
#else
struct NvtxRange {
  explicit NvtxRange(const char*) {}
};
#endif

// NOTE: a ticket packs the copy's sequence number (for its state byte) and
// its record index (for O(1) access while live): ticket = seq << 24 | rec.
constexpr int kRecBits = 24;
constexpr std::int64_t kRecMask = (std::int64_t(1) << kRecBits) - 1;
// The record array stays at most half full (see reserve_recs), so live
// copies are limited to half of what the record bits can index.
constexpr std::size_t kMaxLiveCopies = std::size_t(1) << (kRecBits - 1);
constexpr std::size_t kDelayRing = 65536;
// NOTE: a finished copy's state stays readable by its ticket for the next
// kStateRing copies (a ring, not a per-copy history that grows forever in a
// server that runs for days); an older ticket is reported as expired.
constexpr std::size_t kStateRing = std::size_t(1) << 22;
constexpr std::uint8_t kLiveMark = 0xFF;  // ring entry of a copy still live
// How long an idle CUDA worker spins before parking (see run()).
constexpr std::chrono::microseconds kIdleSpin{200};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// NOTE: a contended glibc mutex parks the thread in the kernel at once; the
// unlocker then pays a futex wake-up syscall and the parked thread tens of
// microseconds of wake-up latency. Every critical section of the issuer is
// short (a 768-copy submit is the longest), and the submitting thread and the
// worker meet on the lock every few microseconds while small chunks complete,
// so parking at once would multiply a busy submit's cost: both spin for the
// lock a while before parking (cuda/README.md has the measurements).
constexpr int kLockSpins = 4096;
void lock_spinning(std::unique_lock<std::mutex>& lk) {
  for (int i = 0; i < kLockSpins; ++i) {
    if (lk.try_lock()) return;
    cpu_relax();
  }
  lk.lock();
}

inline std::int64_t make_ticket(std::int64_t seq, std::int32_t rec) {
  return (seq << kRecBits) | rec;
}

// Open addressing (linear probing, backward-shift deletion) map of live keys.
// NOTE: std::unordered_map costs ~2 allocations per insert; a 768-copy submit
// must stay in the tens of microseconds.
class KeyMap {
 public:
  // NOTE: 16384 slots to start with (256 KB): the worker's erasures of the
  // last block then touch few of the lines the next block's probes use.
  KeyMap() { rehash(16384); }
  std::int32_t find(std::uint64_t key) const {
    std::size_t i = slot_of(key);
    while (slots_[i].key != kNoKey) {
      if (slots_[i].key == key) return slots_[i].val;
      i = (i + 1) & mask_;
    }
    return kMissing;
  }
  void set(std::uint64_t key, std::int32_t val) {
    if ((count_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = slot_of(key);
    while (slots_[i].key != kNoKey) {
      if (slots_[i].key == key) {
        slots_[i].val = val;
        return;
      }
      i = (i + 1) & mask_;
    }
    slots_[i] = Slot{key, val};
    ++count_;
  }
  void erase(std::uint64_t key) {
    std::size_t i = slot_of(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == kNoKey) return;
      i = (i + 1) & mask_;
    }
    // backward-shift deletion keeps probe chains intact without tombstones
    std::size_t j = i;
    while (true) {
      j = (j + 1) & mask_;
      if (slots_[j].key == kNoKey) break;
      std::size_t home = slot_of(slots_[j].key);
      bool movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = kNoKey;
    --count_;
  }
  // Capacity for `count` keys without a rehash (slot indices stay valid).
  void reserve(std::size_t count) {
    std::size_t cap = slots_.size();
    while (count * 2 > cap) cap *= 2;
    if (cap != slots_.size()) rehash(cap);
  }
  // One probe: the slot of `key`, inserting it with `val` when absent
  // (*found = kMissing) -- call reserve() first; else *found = its value.
  // The insertion is not counted: the caller adds its insertions with
  // add_count() once per batch.
  // NOTE: the count is also written by the worker's erases, so a submit
  // that counted each insertion would pull its cache line across cores
  // once per copy.
  std::size_t find_or_insert_uncounted(std::uint64_t key, std::int32_t val, std::int32_t* found) {
    std::size_t i = slot_of(key);
    while (slots_[i].key != kNoKey) {
      if (slots_[i].key == key) {
        *found = slots_[i].val;
        return i;
      }
      i = (i + 1) & mask_;
    }
    slots_[i] = Slot{key, val};
    *found = kMissing;
    return i;
  }
  void add_count(std::size_t k) { count_ += k; }
  void set_at(std::size_t slot, std::int32_t val) { slots_[slot].val = val; }
  void prefetch(std::uint64_t key) const { __builtin_prefetch(&slots_[slot_of(key)], 1); }
  std::size_t size() const { return count_; }
  static constexpr std::int32_t kMissing = -1;

 private:
  // NOTE: key and value side by side: one cache line per probe (the lines a
  // submit touches were last written by the worker's erases, on another core).
  struct Slot {
    std::uint64_t key;
    std::int32_t val;
  };
  std::size_t slot_of(std::uint64_t key) const {
    std::uint64_t h = key * 0x9E3779B97F4A7C15ull;  // Fibonacci hashing
    return std::size_t(h >> 17) & mask_;
  }
  void rehash(std::size_t cap) {
    std::vector<Slot> old(cap, Slot{kNoKey, 0});
    old.swap(slots_);
    mask_ = cap - 1;
    count_ = 0;
    for (const Slot& e : old)
      if (e.key != kNoKey) set(e.key, e.val);
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  alignas(64) std::size_t count_ = 0;  // written by the worker's erasures
};

// NOTE: one cache line per copy (a 768-copy submit writes 768 of them);
// the submit time lives in a parallel array (Impl::submit_time). Counters
// bounded by the window (in-flight and not-yet-enqueued chunks, the slot)
// fit 16 bits: max_inflight_chunks <= 4096; pieces fit 32 bits:
// chunk_bytes <= 1 GiB.
struct alignas(64) CopyRec {
  std::int64_t seq = 0;  // 0: free
  std::uintptr_t src = 0, dst = 0;
  std::size_t bytes = 0;
  std::uint64_t key = kNoKey;
  std::size_t next_off = 0;     // first byte not yet issued
  std::uint32_t piece = 0;      // chunk size of this copy (equal split)
  std::int32_t chunks_issued = 0;
  std::int16_t chunks_inflight = 0;
  std::int16_t chunks_unenqueued = 0;  // issued chunks the backend has not accepted yet
  std::int16_t last_slot = -1;         // slot of the most recently enqueued chunk
  std::uint8_t band = 0;
  std::uint8_t state = kQueued;  // kQueued or kRunning while live; bit 7: failed
  bool failed() const { return (state & kFailedBit) != 0; }
  void set_failed() { state = std::uint8_t(state | kFailedBit); }
  std::uint8_t live_state() const { return std::uint8_t(state & ~kFailedBit); }
  static constexpr std::uint8_t kFailedBit = 0x80;
};
static_assert(sizeof(CopyRec) == 64, "one cache line per copy record");

struct Inflight {
  int slot;
  std::int32_t rec;
  std::int64_t seq;
  std::int64_t chunk;
  std::size_t bytes;
  double t_enqueued;
};

struct BandCounters {
  std::uint64_t copies = 0, bytes = 0, submitted = 0, dedup_hits = 0, promotions = 0,
                cancellations = 0, failures = 0;
  double blocked_wait_s = 0.0;
  std::vector<float> delays;  // ring of the last kDelayRing queue delays
  std::size_t delay_next = 0;
  void add_delay(double d) {
    if (delays.size() < kDelayRing) {
      delays.push_back(float(d));
    } else {
      delays[delay_next] = float(d);
      delay_next = (delay_next + 1) % kDelayRing;
    }
  }
};

double quantile(std::vector<float> v, double q) {
  if (v.empty()) return std::nan("");
  // nearest rank
  std::size_t k = std::size_t(std::ceil(q * double(v.size())));
  if (k > 0) --k;
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(k), v.end());
  return double(v[k]);
}

// A FIFO on one growable power-of-two ring: unlike std::deque it keeps its
// storage when drained, so steady-state submits allocate nothing per copy.
template <class T>
class Ring {
 public:
  bool empty() const { return head_ == tail_; }
  std::size_t size() const { return tail_ - head_; }
  T& front() { return buf_[head_ & mask_]; }
  void pop_front() { ++head_; }
  void push_back(const T& v) {
    if (size() == buf_.size()) grow(size() + 1);
    buf_[tail_++ & mask_] = v;
  }
  void reserve(std::size_t n) {
    if (n > buf_.size()) grow(n);
  }
  // k items at once: the tail index (read by the popping worker) is written
  // once per batch, not per item.
  void append(const T* items, std::size_t k) {
    if (size() + k > buf_.size()) grow(size() + k);
    std::size_t t = tail_;
    for (std::size_t i = 0; i < k; ++i) buf_[(t + i) & mask_] = items[i];
    tail_ = t + k;
  }
  void clear() { head_ = tail_ = 0; }
  template <class F>
  void retain_if(F keep) {  // keeps order
    std::size_t out = head_;
    for (std::size_t i = head_; i != tail_; ++i)
      if (keep(buf_[i & mask_])) buf_[out++ & mask_] = buf_[i & mask_];
    tail_ = out;
  }

 private:
  void grow(std::size_t need) {
    std::size_t cap = std::max<std::size_t>(64, buf_.size());
    while (cap < need) cap *= 2;
    std::vector<T> next(cap);
    for (std::size_t i = head_; i != tail_; ++i) next[i - head_] = buf_[i & mask_];
    tail_ -= head_;
    head_ = 0;
    buf_.swap(next);
    mask_ = cap - 1;
  }
  std::vector<T> buf_;
  std::size_t mask_ = 0;
  alignas(64) std::size_t head_ = 0;  // the worker pops
  alignas(64) std::size_t tail_ = 0;  // submits push
};

// Equal split: a copy of n bytes becomes k = ceil(n / chunk) chunks of one
// size p (the last one n - (k-1) p, never larger), p rounded up to the
// alignment of chunk_bytes (at most 64 KiB), so p <= chunk_bytes.
// NOTE: a 9 MiB copy with 8 MiB chunks is 4.5 + 4.5 MiB, not 8 + 1: the chunk
// queued behind the running one always lasts about a full chunk, so a late
// worker wake-up does not leave the copy engine idle after a short tail.
std::size_t split_piece_bytes(std::size_t n, std::size_t chunk) {
  if (n <= chunk) return n;
  std::size_t k = (n + chunk - 1) / chunk;
  std::size_t align = std::min<std::size_t>(chunk & (~chunk + 1), std::size_t(64) << 10);
  std::size_t p = (n + k - 1) / k;
  return (p + align - 1) / align * align;
}

std::string hex(std::uintptr_t p) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)p);
  return buf;
}

// Address ranges [begin, end) the issuer may touch on one side of a copy.
// Regions may overlap or repeat (the same buffer registered twice, a
// registration inside a pinned buffer); a range is inside the set when one
// region holds all of it.
// NOTE: sorted by begin with a prefix maximum of end: among the regions that
// begin at or before p, the one reaching furthest holds [p, p + n) if any
// does, so one binary search answers; and a batch's copies usually come
// from one pool, so the last region that answered is tried first (two
// compares per copy in a 768-copy submit).
class RegionSet {
 public:
  bool contains(std::uintptr_t p, std::size_t n) {
    std::uintptr_t off = p - hit_begin_;
    if (off < hit_len_ && n <= hit_len_ - off) return true;
    return contains_slow(p, n);
  }
  void add(std::uintptr_t begin, std::size_t n) {
    Region r{begin, begin + n};
    regions_.insert(std::upper_bound(regions_.begin(), regions_.end(), r), r);
    rebuild();
  }
  // Removes one region equal to [begin, begin + n); false when there is none.
  bool remove_exact(std::uintptr_t begin, std::size_t n) {
    Region r{begin, begin + n};
    auto it = std::lower_bound(regions_.begin(), regions_.end(), r);
    if (it == regions_.end() || !(*it == r)) return false;
    regions_.erase(it);
    rebuild();
    return true;
  }
  // Removes every region that begins inside [begin, begin + n).
  void remove_inside(std::uintptr_t begin, std::size_t n) {
    regions_.erase(std::remove_if(regions_.begin(), regions_.end(),
                                  [&](const Region& r) { return r.begin - begin < n; }),
                   regions_.end());
    rebuild();
  }
  std::size_t size() const { return regions_.size(); }
  // For error messages: the region nearest to [p, p + n) (the last one
  // beginning at or before p, else the first one after it).
  std::string nearest(std::uintptr_t p, std::size_t n) const {
    if (regions_.empty()) return "none is registered";
    auto it = std::upper_bound(regions_.begin(), regions_.end(), Region{p, ~std::uintptr_t(0)});
    const Region& r = it == regions_.begin() ? *it : *std::prev(it);
    std::string text = "nearest: [" + hex(r.begin) + ", " + hex(r.end) + ") of " +
                       std::to_string(r.end - r.begin) + " bytes, ";
    if (p < r.begin) return text + "beginning " + std::to_string(r.begin - p) + " bytes after it";
    if (p >= r.end) return text + "ending " + std::to_string(p - r.end) + " bytes before it";
    return text + "ending " + std::to_string(n - (r.end - p)) + " bytes short of its end";
  }

 private:
  struct Region {
    std::uintptr_t begin, end;
    bool operator<(const Region& o) const {
      return begin != o.begin ? begin < o.begin : end < o.end;
    }
    bool operator==(const Region& o) const { return begin == o.begin && end == o.end; }
  };
  bool contains_slow(std::uintptr_t p, std::size_t n) {
    auto it = std::upper_bound(regions_.begin(), regions_.end(), Region{p, ~std::uintptr_t(0)});
    if (it == regions_.begin()) return false;
    std::size_t i = std::size_t(it - regions_.begin()) - 1;
    const Region& r = regions_[reach_[i]];
    // r.begin <= p; r.end > p and the whole range fits (no wrap-around)
    if (r.end <= p || n > r.end - p) return false;
    hit_begin_ = r.begin;
    hit_len_ = r.end - r.begin;
    return true;
  }
  void rebuild() {
    reach_.resize(regions_.size());
    for (std::size_t i = 0; i < regions_.size(); ++i)
      reach_[i] = i > 0 && regions_[reach_[i - 1]].end >= regions_[i].end ? reach_[i - 1] : i;
    hit_begin_ = hit_len_ = 0;
  }
  std::vector<Region> regions_;  // sorted
  std::vector<std::size_t> reach_;  // reach_[i]: the region of regions_[0..i] ending last
  std::uintptr_t hit_begin_ = 0, hit_len_ = 0;  // the last region that answered
};

}  // namespace

struct Issuer::Impl {
  IssuerConfig cfg;
  std::unique_ptr<CopyBackend> backend;
  std::string backend_name;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();

  mutable std::mutex mu;
  std::condition_variable work_cv;   // worker: new work or stop
  std::condition_variable state_cv;  // waiters: a copy finished / chunks issued
  // NOTE: alignas(64) below keeps what the worker writes often off the cache
  // lines a submit reads or writes per copy (false sharing moved those lines
  // between the cores on every copy while the worker was busy; issue 4).
  alignas(64) std::atomic<std::uint64_t> epoch{0};
  // NOTE: what the worker is blocked on, so submit() makes a wake-up call
  // (a futex syscall that can also get the submitting thread preempted by
  // the woken worker) only when it is needed: `parked` = idle on work_cv;
  // `room_wait` = waiting for progress with room in the window (new work
  // would be issued at once). Written by the worker under `mu`.
  std::atomic<bool> parked{false};
  std::atomic<bool> room_wait{false};
  std::atomic<bool> stop{false};
  alignas(64) bool closed = false;
  std::thread worker;
  // the worker's kernel thread id (Linux; 0 until it has started)
  std::atomic<std::int64_t> worker_tid{0};

  // NOTE: records are taken by a cursor that walks the array (skipping live
  // ones) rather than from a LIFO free list: a batch's records then lie side
  // by side in the order the worker finishes them, so a submit writes
  // consecutive cache lines instead of scattered ones (issue 4).
  alignas(64) std::vector<CopyRec> recs;
  std::vector<double> submit_time;  // by record: when its copy was submitted
  std::size_t rec_cursor = 0;
  alignas(64) std::size_t live_recs = 0;
  // Final states by seq (see kStateRing); grows to kStateRing, then wraps.
  alignas(64) std::vector<std::uint8_t> final_states =
      std::vector<std::uint8_t>(1024, kLiveMark);
  std::unordered_map<std::int64_t, std::string> errors;  // seq -> failure or cancel text
  std::int64_t next_seq = 1;
  alignas(64) KeyMap live_keys;
  Ring<std::pair<std::int32_t, std::int64_t>> queues[kNumBands];  // (rec, seq)
  alignas(64) std::uint64_t queued_copies = 0;
  std::uint64_t queued_bytes = 0;  // bytes not yet issued, over live copies

  std::deque<Inflight> inflight;
  std::size_t inflight_bytes = 0;
  double rate_bps = 0.0;     // link rate estimate (EWMA over finished chunks)
  double last_reap_t = 0.0;  // when the worker last saw a chunk finish
  std::vector<int> free_slots;

  // Memory copies may read (pinned host) and write (device; host backend:
  // host); a submit rejects a copy outside them. Changed under `mu`.
  alignas(64) RegionSet sources;
  RegionSet destinations;
  // submit() scratch and undo log, kept to avoid allocating per call.
  std::vector<std::int32_t> batch_created;                           // records it created
  std::vector<std::pair<std::int32_t, std::uint8_t>> batch_promoted;  // (record, old band)
  std::vector<std::pair<std::int32_t, std::int64_t>> batch_entries;  // queue entries, in order
  // Submit timing (cumulative), for the issue-cost breakdown in stats().
  std::uint64_t submit_calls = 0;
  double submit_lock_wait_s = 0.0, submit_locked_s = 0.0;

  alignas(64) BandCounters counters[kNumBands];
  double link_busy_s = 0.0;
  std::uint64_t chunks_done = 0;
  std::vector<LogEvent> log;
  int state_waiters = 0;

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void record(LogKind kind, int band, std::int64_t ticket, std::int64_t chunk, std::int64_t bytes,
              bool ok) {
    if (cfg.debug_log)
      log.push_back(LogEvent{now(), kind, band, ticket, chunk, bytes, ok ? 1 : 0});
  }

  // ---- records ----
  // Room for `n` more live records with the array at most half full, so the
  // cursor finds a free one within a few steps. Call before new_rec().
  void reserve_recs(std::size_t n) {
    // NOTE: at least 16384 records (1 MB): the cursor then reuses a record
    // long after the worker last wrote it (no longer in that core's cache).
    std::size_t want = std::max<std::size_t>(16384, 2 * (live_recs + n));
    if (recs.size() < want) {
      recs.resize(std::min(std::max(want, 2 * recs.size()), std::size_t(1) << kRecBits));
      submit_time.resize(recs.size());
    }
  }
  // The caller initialises the whole record (`= CopyRec{}` first).
  std::int32_t new_rec() {
    while (recs[rec_cursor].seq != 0) rec_cursor = rec_cursor + 1 == recs.size() ? 0 : rec_cursor + 1;
    std::int32_t r = std::int32_t(rec_cursor);
    rec_cursor = rec_cursor + 1 == recs.size() ? 0 : rec_cursor + 1;
    // NOTE: the records a batch takes were last written by the worker on
    // another core; fetching them a few copies ahead overlaps those misses.
    std::size_t a = rec_cursor + 6;  // no modulo: a division per copy costs more than the miss
    if (a >= recs.size()) a -= recs.size();
    __builtin_prefetch(&recs[a], 1);
    return r;  // the caller adds to live_recs once per batch
  }
  // Only the sequence number is cleared (one write by the worker): a record
  // with seq 0 is free, and new_rec()'s caller rewrites all of it.
  void free_rec(std::int32_t r) {
    recs[std::size_t(r)].seq = 0;
    --live_recs;
  }
  std::size_t live_copies() const { return live_recs; }

  bool queued_in(std::int32_t r, std::int64_t seq, int band) const {
    const CopyRec& c = recs[std::size_t(r)];
    return c.seq == seq && c.band == band && !c.failed() && c.next_off < c.bytes;
  }

  // The next chunk by band, then FIFO; drops stale queue entries.
  std::int32_t pick() {
    for (int b = 0; b < kNumBands; ++b) {
      auto& q = queues[b];
      while (!q.empty()) {
        auto [r, seq] = q.front();
        if (queued_in(r, seq, b)) return r;
        q.pop_front();
      }
    }
    return -1;
  }

  // NOTE: admission counts a full chunk_bytes for the next chunk, whatever
  // its size: with equal split a 9 MiB copy makes 4.5 MiB chunks, and a
  // 16 MiB window would otherwise hold three of them (13.5 MiB ahead of an
  // on-demand copy instead of ~9). So a 2-chunk window keeps two chunks in
  // flight (one running, one queued) for any copy size >= chunk_bytes / 2.
  bool window_has_room() const {
    if (inflight.empty()) return true;  // always admit one chunk, whatever its size
    return inflight.size() < std::size_t(cfg.max_inflight_chunks) &&
           inflight_bytes + cfg.chunk_bytes <= cfg.window_bytes;
  }

  // Just-in-time issue: the earliest time (issuer seconds) at which one more
  // chunk may be queued behind the in-flight ones; -inf when it may be now.
  double jit_not_before() const {
    if (cfg.issue_lead_s <= 0.0 || inflight.empty() || rate_bps <= 0.0)
      return -std::numeric_limits<double>::infinity();
    // The oldest in-flight chunk started when it was enqueued or when the
    // worker saw its predecessor finish, whichever was later (an upper bound).
    double start = std::max(inflight.front().t_enqueued, last_reap_t);
    return start + double(inflight_bytes) / rate_bps - cfg.issue_lead_s;
  }

  // A chunk claimed under the lock, enqueued on the backend without it.
  struct Pending {
    int slot;
    std::int32_t rec;
    std::int64_t seq;
    std::int64_t chunk;
    std::size_t bytes;
    void* dst;
    const void* src;
  };
  std::vector<Pending> pending;  // worker only; keeps its capacity

  // Claims chunks by the rule under the lock (they count as in flight at
  // once), then enqueues them with the lock released and retakes it.
  // NOTE: the backend enqueue (cudaMemcpyAsync + two event records, a few
  // microseconds per chunk) ran under the issuer mutex before, so a submit
  // arriving while the worker filled the window waited for the whole fill
  // (issue 4). Only this worker claims, enqueues and reaps, so the stream
  // order is the claim order. stream_wait() uses a copy's last slot only
  // once every issued chunk is enqueued (chunks_unenqueued == 0).
  void fill_window(std::unique_lock<std::mutex>& lk) {
    pending.clear();
    while (true) {
      std::int32_t r = pick();
      if (r < 0) break;
      CopyRec& c = recs[std::size_t(r)];
      std::size_t n = std::min<std::size_t>(c.piece, c.bytes - c.next_off);
      if (!window_has_room()) break;
      if (now() < jit_not_before()) break;
      int slot = free_slots.back();
      free_slots.pop_back();
      std::int64_t ticket = make_ticket(c.seq, r);
      std::int64_t chunk = c.chunks_issued;
      if (c.chunks_issued == 0) {
        c.state = std::uint8_t((c.state & CopyRec::kFailedBit) | kRunning);
        counters[c.band].add_delay(now() - submit_time[std::size_t(r)]);
      }
      record(kLogStart, c.band, ticket, chunk, std::int64_t(n), true);
      pending.push_back(Pending{slot, r, c.seq, chunk, n,
                                reinterpret_cast<void*>(c.dst + c.next_off),
                                reinterpret_cast<const void*>(c.src + c.next_off)});
      c.next_off += n;
      c.chunks_issued += 1;
      c.chunks_unenqueued += 1;
      queued_bytes -= n;
      if (c.next_off == c.bytes) --queued_copies;
      c.chunks_inflight += 1;
      inflight.push_back(Inflight{slot, r, c.seq, chunk, n, now()});
      inflight_bytes += n;
    }
    if (pending.empty()) return;
    lk.unlock();
    // failed enqueues keep their error text in `enqueue_errors` (by index)
    enqueue_errors.assign(pending.size(), std::string());
    bool any_failed = false;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const Pending& p = pending[i];
      if (!backend->enqueue(p.slot, p.dst, p.src, p.bytes, &enqueue_errors[i])) {
        if (enqueue_errors[i].empty()) enqueue_errors[i] = "enqueue failed";
        any_failed = true;
      } else {
        enqueue_errors[i].clear();
      }
    }
    lock_spinning(lk);
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const Pending& p = pending[i];
      CopyRec& c = recs[std::size_t(p.rec)];
      if (!any_failed || enqueue_errors[i].empty()) {
        c.chunks_unenqueued -= 1;
        c.last_slot = std::int16_t(p.slot);  // claim order: the last one set is the last enqueued
        continue;
      }
      // Nothing is in flight for this slot: take it out of the window.
      for (auto it = inflight.begin(); it != inflight.end(); ++it) {
        if (it->slot == p.slot) {
          inflight.erase(it);
          break;
        }
      }
      inflight_bytes -= p.bytes;
      free_slots.push_back(p.slot);
      c.chunks_inflight -= 1;
      c.chunks_unenqueued -= 1;  // settled: stream_wait may use the copy's other chunks
      record(kLogEnd, c.band, make_ticket(p.seq, p.rec), p.chunk, std::int64_t(p.bytes), false);
      chunk_failed(p.rec, enqueue_errors[i]);
      maybe_finish(p.rec);
    }
    // NOTE: stream_wait() callers wait for chunks to be enqueued, not finished.
    if (state_waiters > 0) state_cv.notify_all();
    finished_any = false;
  }
  std::vector<std::string> enqueue_errors;  // worker only

  void chunk_failed(std::int32_t r, const std::string& err) {
    CopyRec& c = recs[std::size_t(r)];
    if (c.failed()) return;
    c.set_failed();
    if (c.next_off < c.bytes) {  // its remaining chunks are dropped
      --queued_copies;
      queued_bytes -= c.bytes - c.next_off;
    }
    set_error(c.seq, err.empty() ? std::string("copy failed") : err);
  }

  // ---- final states ----
  bool expired(std::int64_t seq) const { return std::size_t(next_seq - seq) > kStateRing; }
  std::uint8_t& final_state(std::int64_t seq) {
    return final_states[std::size_t(seq) & (final_states.size() - 1)];
  }
  std::uint8_t final_state_of(std::int64_t seq) const {
    return final_states[std::size_t(seq) & (final_states.size() - 1)];
  }
  // Room in the ring for seqs below next_seq + n (before the ring wraps).
  void reserve_states(std::size_t n) {
    std::size_t need = std::size_t(next_seq) + n;
    std::size_t size = final_states.size();
    while (size < need && size < kStateRing) size *= 2;
    if (size != final_states.size()) final_states.resize(size, kLiveMark);
  }
  void set_final(std::int64_t seq, std::uint8_t st) {
    // An expired seq's entry already belongs to a newer copy.
    if (!expired(seq)) final_state(seq) = st;
  }
  void set_error(std::int64_t seq, std::string text) {
    if (errors.size() >= 4096) {  // drop the texts of expired tickets
      for (auto it = errors.begin(); it != errors.end();)
        it = expired(it->first) ? errors.erase(it) : std::next(it);
    }
    errors[seq] = std::move(text);
  }
  // What wait() reports for a failed or cancelled copy.
  std::string terminal_message(std::int64_t seq, std::uint8_t st) const {
    auto it = errors.find(seq);
    if (it != errors.end()) return it->second;
    return st == kFailed ? "copy failed" : "copy was cancelled before it started";
  }
  // State of a validated ticket (state_of() checked it once).
  std::uint8_t state_now(std::int64_t ticket) const {
    std::int64_t seq = ticket >> kRecBits;
    std::size_t r = std::size_t(ticket & kRecMask);
    // (a ticket naming a finished copy may carry any record index)
    if (r < recs.size() && recs[r].seq == seq) return recs[r].live_state();
    return final_state_of(seq);
  }

  void maybe_finish(std::int32_t r) {
    CopyRec& c = recs[std::size_t(r)];
    if (c.chunks_inflight > 0) return;
    if (!c.failed() && c.next_off < c.bytes) return;
    std::int64_t ticket = make_ticket(c.seq, r);
    BandCounters& bc = counters[c.band];
    if (c.failed()) {
      set_final(c.seq, kFailed);
      bc.failures += 1;
    } else {
      set_final(c.seq, kDone);
      bc.copies += 1;
      bc.bytes += c.bytes;
    }
    record(kLogFinish, c.band, ticket, c.chunks_issued, std::int64_t(c.bytes), !c.failed());
    release_key(r);
    free_rec(r);
    finished_any = true;
  }
  // The copy's key maps to a newer copy once a failed one was resubmitted.
  void release_key(std::int32_t r) {
    const CopyRec& c = recs[std::size_t(r)];
    if (c.key != kNoKey && live_keys.find(c.key) == r) live_keys.erase(c.key);
  }
  // Cancels a live copy none of whose chunks started and frees its record;
  // its queue entry goes stale (pick() and cancel() drop it).
  void cancel_unstarted(std::int32_t r) {
    const CopyRec& c = recs[std::size_t(r)];
    set_final(c.seq, kCancelled);
    counters[c.band].cancellations += 1;
    queued_copies -= 1;
    queued_bytes -= c.bytes;
    record(kLogCancel, c.band, make_ticket(c.seq, r), 0, std::int64_t(c.bytes), true);
    release_key(r);
    free_rec(r);
  }
  // NOTE: set by maybe_finish; callers notify waiters once per batch of
  // finished copies (a notify per copy woke each waiter hundreds of times
  // per block of small copies, each time to take the contended lock).
  bool finished_any = false;
  void notify_finished() {
    if (finished_any && state_waiters > 0) state_cv.notify_all();
    finished_any = false;
  }

  // Finished chunks, oldest first (one stream: they finish in order), found
  // WITHOUT the issuer lock: only the worker changes `inflight`, and a
  // backend query (cudaEventQuery + cudaEventElapsedTime, ~1 us each) under
  // the lock made every submit wait for up to a window of them (issue 4).
  std::vector<ChunkResult> finished;  // worker only; keeps its capacity
  std::size_t n_finished = 0;
  void poll_finished() {
    n_finished = 0;
    for (std::size_t i = 0; i < inflight.size(); ++i) {
      if (finished.size() <= n_finished) finished.emplace_back();
      if (!backend->query(inflight[i].slot, &finished[n_finished])) break;
      ++n_finished;
    }
  }

  // Settles what poll_finished() found (under the lock).
  bool reap() {
    bool any = false;
    for (std::size_t k = 0; k < n_finished; ++k) {
      Inflight f = inflight.front();
      const ChunkResult& res = finished[k];
      inflight.pop_front();
      inflight_bytes -= f.bytes;
      free_slots.push_back(f.slot);
      last_reap_t = now();
      if (res.ok && res.busy_s > 0.0) {
        double r = double(f.bytes) / res.busy_s;
        rate_bps = rate_bps > 0.0 ? 0.8 * rate_bps + 0.2 * r : r;
      }
      link_busy_s += res.busy_s;
      chunks_done += 1;
      CopyRec& c = recs[std::size_t(f.rec)];
      c.chunks_inflight -= 1;
      record(kLogEnd, c.band, make_ticket(f.seq, f.rec), f.chunk, std::int64_t(f.bytes), res.ok);
      if (!res.ok) chunk_failed(f.rec, res.error);
      maybe_finish(f.rec);
      any = true;
    }
    n_finished = 0;
    notify_finished();
    return any;
  }

  void run() {
#if defined(__linux__)
    worker_tid.store(static_cast<std::int64_t>(syscall(SYS_gettid)), std::memory_order_release);
#endif
    detail::count_thread(+1);
    std::unique_lock<std::mutex> lk(mu, std::defer_lock);
    while (true) {
      // Unlocked here at the top of every iteration.
      poll_finished();
      lock_spinning(lk);
      reap();
      bool stopping = stop.load();
      if (!stopping) fill_window(lk);
      if (inflight.empty()) {
        if (stopping) break;
        // NOTE: on CUDA (the worker spins on events while copying anyway)
        // it also spins a short while after going idle before parking: the
        // next block usually follows within tens of microseconds (a caller
        // that waited for the last one), and a parked worker costs that
        // submit a wake-up syscall plus, often, a preemption by the woken
        // worker (issue 4). Not on the host backend (a small shared CPU).
        if (backend->supports_stream_wait()) {
          std::uint64_t seen = epoch.load();
          lk.unlock();
          auto until = std::chrono::steady_clock::now() + kIdleSpin;
          while (epoch.load() == seen && !stop.load() &&
                 std::chrono::steady_clock::now() < until)
            std::this_thread::yield();
          if (epoch.load() != seen || stop.load()) continue;
          lock_spinning(lk);
          if (epoch.load() != seen || stop.load()) {
            lk.unlock();
            continue;
          }
        }
        parked.store(true);
        work_cv.wait(lk, [&] { return stop.load() || pick() >= 0; });
        parked.store(false);
        lk.unlock();
        continue;
      }
      // Room for one more chunk: the next queued one, or (nothing queued)
      // any chunk a new submission may bring.
      std::int32_t next = stopping ? -1 : pick();
      bool room = !stopping && window_has_room();
      // A chunk that fits but waits for its just-in-time moment: wake then.
      auto deadline = std::chrono::steady_clock::time_point::max();
      if (room && next >= 0) {
        double not_before = jit_not_before();
        if (not_before > -std::numeric_limits<double>::infinity())
          deadline = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(not_before));
      }
      std::uint64_t seen = epoch.load();
      int slot = inflight.front().slot;
      room_wait.store(room);
      lk.unlock();
      // NOTE: with room in the window, new submissions interrupt the wait so
      // they are issued at once; with a full window only a completion matters.
      backend->wait_progress(slot, deadline, [&] { return room && epoch.load() != seen; });
      room_wait.store(false);
    }
    // Shut down (the lock is held): every live copy that will never complete
    // is cancelled.
    for (std::size_t r = 0; r < recs.size(); ++r) {
      CopyRec& c = recs[r];
      if (c.seq == 0) continue;
      set_final(c.seq, kCancelled);
      if (c.chunks_issued > 0)
        set_error(c.seq, "issuer shut down after " + std::to_string(c.next_off) + " of " +
                             std::to_string(c.bytes) + " bytes were issued");
      counters[c.band].cancellations += 1;
      record(kLogCancel, c.band, make_ticket(c.seq, std::int32_t(r)), 0, std::int64_t(c.bytes),
             true);
      free_rec(std::int32_t(r));
    }
    for (auto& q : queues) q.clear();
    queued_copies = 0;
    queued_bytes = 0;
    state_cv.notify_all();
    lk.unlock();
    detail::count_thread(-1);
  }

  // ---- tickets ----
  std::int64_t seq_of(std::int64_t ticket) const {
    std::int64_t seq = ticket >> kRecBits;
    if (ticket <= 0 || seq <= 0 || seq >= next_seq)
      throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
    return seq;
  }
  std::uint8_t state_of(std::int64_t ticket) const {
    std::int64_t seq = seq_of(ticket);
    std::size_t r = std::size_t(ticket & kRecMask);
    if (r < recs.size() && recs[r].seq == seq) return recs[r].live_state();
    if (expired(seq))
      throw std::invalid_argument("expired ticket " + std::to_string(ticket) +
                                  " (its copy finished more than " + std::to_string(kStateRing) +
                                  " copies ago)");
    std::uint8_t s = final_state_of(seq);
    // live but not in the record the ticket names: not a ticket we issued
    if (s == kLiveMark) throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
    return s;
  }

  // Checks a new region and the backend's view of it (outside the lock).
  void check_region(const char* what, std::uintptr_t begin, std::size_t n, bool check_backend,
                    bool destination) {
    if (begin == 0 || n == 0 || begin + n < begin)
      throw std::invalid_argument(std::string(what) + ": empty or wrapping region [" + hex(begin) +
                                  ", +" + std::to_string(n) + ")");
    if (!check_backend) return;
    for (std::uintptr_t p : {begin, begin + n - 1}) {
      std::string err;
      bool ok = destination ? backend->destination_is_device(reinterpret_cast<void*>(p), &err)
                            : backend->source_is_pinned(reinterpret_cast<const void*>(p), &err);
      if (!ok)
        throw std::invalid_argument(std::string(what) + ": [" + hex(begin) + ", +" +
                                    std::to_string(n) + ") is not " +
                                    (destination ? "device memory" : "pinned host memory") +
                                    " at " + hex(p) + " (" + err + ")");
    }
  }

  // Cancels the unstarted copies `touches` selects, then waits (lock held
  // by `lk`, released while waiting) until no selected copy is live.
  // `why(c)`: the cancelled copy's error text.
  template <class Touches, class Why>
  std::int64_t drain_copies(std::unique_lock<std::mutex>& lk, Touches touches, Why why) {
    // NOTE: a copy that has not started is cancelled (its memory is about
    // to go away); one that has started is waited for, so no DMA touches
    // freed or unregistered memory.
    std::int64_t cancelled = 0;
    for (std::size_t r = 0; r < recs.size(); ++r) {
      CopyRec& c = recs[r];
      if (c.seq == 0 || !touches(c) || c.chunks_issued > 0) continue;
      set_error(c.seq, why(c));
      cancel_unstarted(std::int32_t(r));
      ++cancelled;
    }
    if (cancelled) state_cv.notify_all();
    state_waiters += 1;
    state_cv.wait(lk, [&] {
      for (const CopyRec& c : recs)
        if (c.seq != 0 && touches(c)) return false;
      return true;
    });
    state_waiters -= 1;
    return cancelled;
  }
};

Issuer::Issuer(const IssuerConfig& config) : impl_(new Impl) {
  Impl& s = *impl_;
  s.cfg = config;
  if (config.chunk_bytes == 0) throw std::invalid_argument("chunk_bytes must be > 0");
  if (config.chunk_bytes > (std::size_t(1) << 30))
    throw std::invalid_argument("chunk_bytes must be <= 1 GiB, got " +
                                std::to_string(config.chunk_bytes));
  if (config.window_bytes < config.chunk_bytes)
    throw std::invalid_argument("window_bytes (" + std::to_string(config.window_bytes) +
                                ") must be >= chunk_bytes (" +
                                std::to_string(config.chunk_bytes) + ")");
  if (config.max_inflight_chunks < 1 || config.max_inflight_chunks > 4096)
    throw std::invalid_argument("max_inflight_chunks must be in [1, 4096], got " +
                                std::to_string(config.max_inflight_chunks));
  if (!(config.issue_lead_s >= 0.0) || std::isinf(config.issue_lead_s))
    throw std::invalid_argument("issue_lead_s must be a finite number >= 0");
  if (!(config.emulated_link_gbps >= 0.0) || std::isinf(config.emulated_link_gbps))
    throw std::invalid_argument("emulated_link_gbps must be a finite number >= 0");
  s.backend = config.use_cuda ? make_cuda_backend(config.max_inflight_chunks, config.device)
                              : make_host_backend(config.max_inflight_chunks,
                                                  config.emulated_link_gbps);
  s.backend_name = s.backend->name();
  for (int i = config.max_inflight_chunks - 1; i >= 0; --i) s.free_slots.push_back(i);
  s.worker = std::thread([this] { impl_->run(); });
  detail::count_issuer(+1);
}

Issuer::~Issuer() {
  shutdown();
  detail::count_issuer(-1);
}

const char* Issuer::backend_name() const { return impl_->backend_name.c_str(); }
std::int64_t Issuer::worker_tid() const { return impl_->worker_tid.load(std::memory_order_acquire); }
const IssuerConfig& Issuer::config() const { return impl_->cfg; }

void Issuer::submit(const std::int64_t* src, const std::int64_t* dst, const std::int64_t* nbytes,
                    std::size_t nbytes_stride, const std::uint64_t* keys, std::size_t n, int band,
                    std::int64_t* tickets_out) {
  NvtxRange range("pdflash.submit");
  Impl& s = *impl_;
  if (band < 0 || band >= kNumBands)
    throw std::invalid_argument("band " + std::to_string(band) + " out of range [0, 3)");
  if (n == 0) return;
  // Checks that need no issuer state run before taking the lock.
  for (std::size_t i = 0; i < n; ++i) {
    if (nbytes[i * nbytes_stride] <= 0)
      throw std::invalid_argument("copy " + std::to_string(i) + ": nbytes must be > 0, got " +
                                  std::to_string(nbytes[i * nbytes_stride]));
    if (src[i] == 0 || dst[i] == 0)
      throw std::invalid_argument("copy " + std::to_string(i) + ": null " +
                                  (src[i] == 0 ? "src" : "dst") + " pointer");
  }
  bool wake_worker = false;
  {
    // NOTE: one lock acquisition per batch; nothing below allocates per copy
    // in the steady state (scratch, records and queues keep their capacity).
    auto t_call = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lk(s.mu, std::defer_lock);
    lock_spinning(lk);
    auto t_locked = std::chrono::steady_clock::now();
    if (s.closed) throw std::runtime_error("issuer is closed");
    if (s.live_copies() + n > kMaxLiveCopies)
      throw std::runtime_error("too many live copies (limit " + std::to_string(kMaxLiveCopies) +
                               ")");
    // NOTE: one pass: each copy is validated and applied in turn (a record,
    // its key and queue entry), with an undo log; a rejected copy rolls the
    // batch back, so a rejected call still changes nothing. Two passes
    // (validate all, then apply) touched every key slot and scratch entry
    // twice (issue 4). What the worker also writes is applied at the end.
    std::vector<std::int32_t>& created = s.batch_created;  // new records, in order
    std::vector<std::pair<std::int32_t, std::uint8_t>>& promoted = s.batch_promoted;
    std::vector<std::pair<std::int32_t, std::int64_t>>& entries = s.batch_entries;
    created.clear();
    promoted.clear();
    entries.clear();
    // NOTE: no rehash during the batch (undo erases by key, but probes for
    // in-batch keys must stay valid).
    s.live_keys.reserve(s.live_keys.size() + n);
    s.reserve_recs(n);
    s.reserve_states(n);
    const std::size_t log_size = s.log.size();
    const std::int64_t first_seq = s.next_seq;
    std::size_t inserted = 0;  // new keys, counted in the key map at the end
    auto fail = [&](const std::string& msg) {
      s.live_keys.add_count(inserted);
      for (std::int32_t r : created) {
        CopyRec& c = s.recs[std::size_t(r)];
        if (c.key != kNoKey) s.live_keys.erase(c.key);
        c.seq = 0;  // free again (next_seq is unchanged: these seqs are reused)
      }
      for (auto [r, old_band] : promoted) s.recs[std::size_t(r)].band = old_band;
      s.log.resize(log_size);
      throw std::invalid_argument(msg);
    };
    double t = s.now();
    std::size_t chunk = s.cfg.chunk_bytes;
    std::int64_t seq = first_seq;
    std::uint64_t new_bytes = 0;
    std::uint64_t dedup_hits = 0, promotions = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (i + 8 < n && keys[i + 8] != kNoKey) s.live_keys.prefetch(keys[i + 8]);
      const std::uintptr_t csrc = std::uintptr_t(src[i]), cdst = std::uintptr_t(dst[i]);
      const std::size_t cbytes = std::size_t(nbytes[i * nbytes_stride]);
      // NOTE: checked here, before the copy is applied: a rejected copy
      // rolls the batch back, so nothing of it is queued.
      if (!s.sources.contains(csrc, cbytes))
        fail("copy " + std::to_string(i) + ": source [" + hex(csrc) + ", +" +
             std::to_string(cbytes) + ") is not inside one registered source region (" +
             s.sources.nearest(csrc, cbytes) +
             "); allocate it with alloc_pinned or register it (register_host, register_source)");
      if (!s.destinations.contains(cdst, cbytes))
        fail("copy " + std::to_string(i) + ": destination [" + hex(cdst) + ", +" +
             std::to_string(cbytes) + ") is not inside one registered destination region (" +
             s.destinations.nearest(cdst, cbytes) + "); register it (register_destination)");
      const std::uint64_t key = keys[i];
      std::int32_t r = s.new_rec();  // taken only if this copy is new (seq set below)
      std::size_t slot = 0;
      if (key != kNoKey) {
        std::int32_t v;
        slot = s.live_keys.find_or_insert_uncounted(key, r, &v);
        if (v == KeyMap::kMissing) {
          ++inserted;
        } else if (s.recs[std::size_t(v)].failed()) {
          // A copy that already failed (its last chunks still in flight) is
          // not a dedup target: the key is copied anew.
          s.live_keys.set_at(slot, r);
        } else {
          CopyRec& c = s.recs[std::size_t(v)];
          if (c.src != csrc || c.dst != cdst || c.bytes != cbytes)
            fail("copy " + std::to_string(i) + ": key " + std::to_string(key) +
                 " is already live with a different src/dst/nbytes");
          // dedup: a live copy, or one created earlier in this batch
          dedup_hits += 1;
          if (band < c.band) {
            bool has_queued = !c.failed() && c.next_off < c.bytes;
            promoted.emplace_back(v, c.band);
            c.band = std::uint8_t(band);
            if (has_queued) {
              entries.emplace_back(v, c.seq);
              promotions += 1;
              s.record(kLogPromote, band, make_ticket(c.seq, v), 0, std::int64_t(c.bytes), true);
              wake_worker = true;
            }
          }
          tickets_out[i] = make_ticket(c.seq, v);
          continue;  // record r stays free (its seq was never set)
        }
      }
      CopyRec& c = s.recs[std::size_t(r)];
      c = CopyRec{};
      c.seq = seq++;
      c.src = csrc;
      c.dst = cdst;
      c.bytes = cbytes;
      c.piece = std::uint32_t(split_piece_bytes(cbytes, chunk));
      c.key = key;
      c.band = std::uint8_t(band);
      s.submit_time[std::size_t(r)] = t;
      s.final_state(c.seq) = kLiveMark;
      created.push_back(r);
      entries.emplace_back(r, c.seq);
      new_bytes += cbytes;
      std::int64_t ticket = make_ticket(c.seq, r);
      if (s.cfg.debug_log)
        s.record(kLogSubmit, band, ticket, std::int64_t((cbytes + chunk - 1) / chunk),
                 std::int64_t(cbytes), true);
      tickets_out[i] = ticket;
      wake_worker = true;
    }
    s.live_keys.add_count(inserted);
    const std::size_t fresh = created.size();
    s.counters[band].dedup_hits += dedup_hits;
    s.counters[band].promotions += promotions;
    s.next_seq = seq;
    s.live_recs += fresh;
    s.queued_copies += fresh;
    s.queued_bytes += new_bytes;
    s.counters[band].submitted += fresh;
    s.queues[band].append(entries.data(), entries.size());
    auto t_done = std::chrono::steady_clock::now();
    s.submit_calls += 1;
    s.submit_lock_wait_s += std::chrono::duration<double>(t_locked - t_call).count();
    s.submit_locked_s += std::chrono::duration<double>(t_done - t_locked).count();
  }
  // NOTE: at most one wake-up per batch, after the lock is released (the
  // worker does not wake only to block on the mutex), none when nothing new
  // is queued, and none when the worker is not blocked where new work would
  // unblock it: a busy worker (window full, or spinning on CUDA events) sees
  // the epoch or the queues on its own. A wake-up call costs a syscall and
  // can get this thread preempted by the woken worker, which costs several
  // times a submit's own work when the worker had gone idle (cuda/README.md).
  if (!wake_worker) return;
  s.epoch.fetch_add(1);
  if (s.parked.load()) s.work_cv.notify_one();
  if (s.room_wait.load()) s.backend->wake();
}

void Issuer::states(const std::int64_t* tickets, std::size_t n, std::uint8_t* out) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  for (std::size_t i = 0; i < n; ++i) out[i] = impl_->state_of(tickets[i]);
}

WaitResult Issuer::wait(const std::int64_t* tickets, std::size_t n, double timeout_s) {
  NvtxRange range("pdflash.wait");
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.mu);
  for (std::size_t i = 0; i < n; ++i) s.state_of(tickets[i]);  // validate all first
  auto t_enter = std::chrono::steady_clock::now();
  auto deadline = t_enter + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
  int blocked_band = kNumBands;
  bool blocked = false;
  WaitResult result;
  std::size_t i = 0;
  s.state_waiters += 1;
  while (i < n) {
    std::int64_t t = tickets[i];
    std::uint8_t st = s.state_now(t);
    if (st >= kDone) {
      if (st != kDone && result.code == kWaitOk) {
        std::int64_t seq = t >> kRecBits;
        result.code = st == kFailed ? kWaitFailed : kWaitCancelled;
        result.ticket = t;
        result.message = s.terminal_message(seq, st);
      }
      ++i;
      continue;
    }
    if (!blocked) {
      // NOTE: blocked time is charged to the most urgent band still pending.
      for (std::size_t j = i; j < n; ++j) {
        std::int64_t tj = tickets[j];
        if (s.state_now(tj) < kDone)
          blocked_band = std::min<int>(blocked_band, s.recs[std::size_t(tj & kRecMask)].band);
      }
      blocked = true;
    }
    if (timeout_s < 0) {
      s.state_cv.wait(lk);
    } else if (s.state_cv.wait_until(lk, deadline) == std::cv_status::timeout &&
               s.state_now(t) < kDone) {
      result.code = kWaitTimeout;
      result.ticket = t;
      result.message = "timed out after " + std::to_string(timeout_s) + " s waiting for ticket " +
                       std::to_string(t);
      break;
    }
  }
  s.state_waiters -= 1;
  if (blocked && blocked_band < kNumBands)
    s.counters[blocked_band].blocked_wait_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_enter).count();
  return result;
}

WaitResult Issuer::stream_wait(const std::int64_t* tickets, std::size_t n, std::uintptr_t stream,
                               double timeout_s) {
  Impl& s = *impl_;
  if (!s.backend->supports_stream_wait()) return wait(tickets, n, timeout_s);
  NvtxRange range("pdflash.stream_wait");
  std::unique_lock<std::mutex> lk(s.mu);
  for (std::size_t i = 0; i < n; ++i) s.state_of(tickets[i]);
  auto t_enter = std::chrono::steady_clock::now();
  auto deadline = t_enter + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
  int blocked_band = kNumBands;
  bool blocked = false;
  WaitResult result;
  s.state_waiters += 1;
  for (std::size_t i = 0; i < n && result.code == kWaitOk;) {
    std::int64_t t = tickets[i];
    std::int64_t seq = t >> kRecBits;
    std::uint8_t st = s.state_now(t);
    if (st == kDone) {
      ++i;
      continue;
    }
    if (st == kFailed || st == kCancelled) {
      result.code = st == kFailed ? kWaitFailed : kWaitCancelled;
      result.ticket = t;
      result.message = s.terminal_message(seq, st);
      break;
    }
    const CopyRec& c = s.recs[std::size_t(t & kRecMask)];
    if (c.failed()) {  // an earlier chunk failed while later ones are in flight
      result.code = kWaitFailed;
      result.ticket = t;
      result.message = s.terminal_message(seq, kFailed);
      break;
    }
    if (c.next_off == c.bytes && c.chunks_inflight > 0 && c.chunks_unenqueued == 0) {
      // All chunks issued: the last one's event covers the whole copy (FIFO).
      std::string err;
      if (!s.backend->stream_wait_slot(c.last_slot, stream, &err)) {
        result.code = kWaitFailed;
        result.ticket = t;
        result.message = err;
        break;
      }
      ++i;
      continue;
    }
    if (!blocked) {
      blocked = true;
      blocked_band = c.band;
    }
    // Not fully issued (or enqueued) yet: wait (host) until it is or finishes.
    // NOTE: a copy whose chunks are all issued is only being enqueued by the
    // worker, which notifies when done: past the deadline it is waited for
    // without one instead of spinning on a timed-out wait.
    bool issued = c.next_off == c.bytes;
    if (timeout_s < 0 || (issued && std::chrono::steady_clock::now() >= deadline)) {
      s.state_cv.wait(lk);
    } else if (s.state_cv.wait_until(lk, deadline) == std::cv_status::timeout) {
      const CopyRec& c2 = s.recs[std::size_t(t & kRecMask)];
      if (s.state_now(t) < kDone && c2.next_off < c2.bytes) {
        result.code = kWaitTimeout;
        result.ticket = t;
        result.message = "timed out after " + std::to_string(timeout_s) +
                         " s waiting for ticket " + std::to_string(t) + " to be issued";
      }
    }
  }
  s.state_waiters -= 1;
  if (blocked && blocked_band < kNumBands)
    s.counters[blocked_band].blocked_wait_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_enter).count();
  return result;
}

std::int64_t Issuer::cancel(int band) {
  Impl& s = *impl_;
  if (band >= kNumBands)
    throw std::invalid_argument("band " + std::to_string(band) + " out of range [0, 3)");
  std::lock_guard<std::mutex> lk(s.mu);
  std::int64_t cancelled = 0;
  for (int b = 0; b < kNumBands; ++b) {
    if (band >= 0 && b != band) continue;
    s.queues[b].retain_if([&](const std::pair<std::int32_t, std::int64_t>& e) {
      auto [r, seq] = e;
      if (!s.queued_in(r, seq, b)) return false;  // stale entry: drop it
      if (s.recs[std::size_t(r)].chunks_issued > 0) return true;  // started: runs to completion
      s.cancel_unstarted(r);
      ++cancelled;
      return false;
    });
  }
  if (cancelled) s.state_cv.notify_all();
  return cancelled;
}

void Issuer::cancel_unstarted(const std::int64_t* tickets, std::size_t n, std::uint8_t* out) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  for (std::size_t i = 0; i < n; ++i) s.state_of(tickets[i]);  // validate all first
  bool any = false;
  for (std::size_t i = 0; i < n; ++i) {
    std::int64_t seq = tickets[i] >> kRecBits;
    std::size_t r = std::size_t(tickets[i] & kRecMask);
    out[i] = 0;
    if (r >= s.recs.size()) continue;
    const CopyRec& c = s.recs[r];
    // a live copy none of whose chunks was issued: its queue entry goes stale
    if (c.seq != seq || c.failed() || c.chunks_issued > 0) continue;
    s.cancel_unstarted(std::int32_t(r));
    out[i] = 1;
    any = true;
  }
  if (any) s.state_cv.notify_all();
}

IssuerStats Issuer::stats() const {
  const Impl& s = *impl_;
  // NOTE: the delay rings are copied under the lock and their quantiles
  // computed after it (nth_element over 64K samples per band would hold up
  // submits for a millisecond).
  std::vector<float> delays[kNumBands];
  std::unique_lock<std::mutex> lk(s.mu);
  IssuerStats out{};
  for (int b = 0; b < kNumBands; ++b) {
    const BandCounters& c = s.counters[b];
    BandStats& o = out.bands[b];
    o.copies = c.copies;
    o.bytes = c.bytes;
    o.submitted = c.submitted;
    o.dedup_hits = c.dedup_hits;
    o.promotions = c.promotions;
    o.cancellations = c.cancellations;
    o.failures = c.failures;
    o.blocked_wait_s = c.blocked_wait_s;
    o.delay_samples = c.delays.size();
    delays[b] = c.delays;
  }
  out.link_busy_s = s.link_busy_s;
  out.uptime_s = s.now();
  out.chunks = s.chunks_done;
  out.queued_copies = s.queued_copies;
  out.queued_bytes = s.queued_bytes;
  out.inflight_chunks = s.inflight.size();
  out.inflight_bytes = s.inflight_bytes;
  out.link_rate_estimate_bps = s.rate_bps;
  out.submit_calls = s.submit_calls;
  out.submit_lock_wait_s = s.submit_lock_wait_s;
  out.submit_locked_s = s.submit_locked_s;
  lk.unlock();
  for (int b = 0; b < kNumBands; ++b) {
    out.bands[b].queue_delay_p50_s = quantile(delays[b], 0.5);
    out.bands[b].queue_delay_p99_s = quantile(std::move(delays[b]), 0.99);
  }
  return out;
}

LinkState Issuer::link_state() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  return LinkState{s.queued_copies, std::uint64_t(s.inflight.size()), s.rate_bps};
}

std::vector<LogEvent> Issuer::debug_log() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->log;
}

void Issuer::add_source_region(std::uintptr_t begin, std::size_t n, bool check_pinned) {
  Impl& s = *impl_;
  s.check_region("source region", begin, n, check_pinned, false);
  std::lock_guard<std::mutex> lk(s.mu);
  s.sources.add(begin, n);
}

void Issuer::add_destination_region(std::uintptr_t begin, std::size_t n, bool check_device) {
  Impl& s = *impl_;
  s.check_region("destination region", begin, n, check_device, true);
  std::lock_guard<std::mutex> lk(s.mu);
  s.destinations.add(begin, n);
}

std::int64_t Issuer::release_region(std::uintptr_t begin, std::size_t n) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.mu);
  auto inside = [&](std::uintptr_t p) { return p - begin < n; };
  std::int64_t cancelled = s.drain_copies(
      lk, [&](const CopyRec& c) { return inside(c.src) || inside(c.dst); },
      [&](const CopyRec& c) {
        return inside(c.src) ? "copy was cancelled: its source region was released"
                             : "copy was cancelled: its destination region was released";
      });
  s.sources.remove_inside(begin, n);
  s.destinations.remove_inside(begin, n);
  return cancelled;
}

std::int64_t Issuer::remove_source_region(std::uintptr_t begin, std::size_t n) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.mu);
  // NOTE: forgotten first, so no new copy from it is accepted while we wait.
  if (!s.sources.remove_exact(begin, n))
    throw std::invalid_argument("no source region [" + hex(begin) + ", +" + std::to_string(n) +
                                ") is registered");
  return s.drain_copies(
      lk, [&](const CopyRec& c) { return c.src - begin < n; },
      [](const CopyRec&) { return "copy was cancelled: its source region was unregistered"; });
}

std::int64_t Issuer::remove_destination_region(std::uintptr_t begin, std::size_t n) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.mu);
  if (!s.destinations.remove_exact(begin, n))
    throw std::invalid_argument("no destination region [" + hex(begin) + ", +" +
                                std::to_string(n) + ") is registered");
  return s.drain_copies(
      lk, [&](const CopyRec& c) { return c.dst - begin < n; },
      [](const CopyRec&) {
        return "copy was cancelled: its destination region was unregistered";
      });
}

bool Issuer::test_hold_link(bool hold) {
  if (closed()) return false;
  return impl_->backend->set_hold(hold);
}
bool Issuer::test_inject_failures(int count, const std::string& text) {
  return impl_->backend->inject_failures(count, text);
}

void Issuer::shutdown() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.closed) return;
    s.closed = true;
    s.stop.store(true);
  }
  s.backend->set_hold(false);  // a held test link must drain
  s.work_cv.notify_all();
  s.backend->wake();
  if (s.worker.joinable()) s.worker.join();
  // NOTE: the backend object stays until ~Issuer (a racing submit may still
  // call wake()); close() frees its stream, events and engine thread now.
  s.backend->close();
}

bool Issuer::closed() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->closed;
}

}  // namespace pdflash
