// Host backend: chunks are copied with memcpy, in FIFO order, by one engine
// thread that plays the copy engine. An optional emulated link bandwidth
// stretches each chunk to bytes / bandwidth, so the band physics of a real
// link (the engine serves whatever is already queued) shows up on a CPU.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pdflash/copy_backend.h"

namespace pdflash {

namespace {
std::atomic<std::int64_t> g_issuers{0}, g_threads{0}, g_pinned{0}, g_registrations{0};
}  // namespace

namespace detail {
void count_thread(int delta) { g_threads.fetch_add(delta); }
void count_issuer(int delta) { g_issuers.fetch_add(delta); }
// Defined in cuda_backend.cpp.
void* cuda_alloc_pinned(int device, std::size_t n);
void cuda_free_pinned(void* p) noexcept;
void cuda_register_host(void* p, std::size_t n);
void cuda_unregister_host(void* p) noexcept;
}  // namespace detail

LiveCounts live_counts() {
  return LiveCounts{g_issuers.load(), g_threads.load(), g_pinned.load(), g_registrations.load()};
}

void* alloc_pinned(bool cuda, int device, std::size_t n) {
  if (n == 0) throw std::invalid_argument("alloc_pinned: nbytes must be > 0");
  void* p = nullptr;
  if (cuda) {
    p = detail::cuda_alloc_pinned(device, n);
  } else {
    std::size_t rounded = (n + 4095) / 4096 * 4096;
    p = std::aligned_alloc(4096, rounded);
    if (p == nullptr) throw std::runtime_error("alloc_pinned: out of host memory");
    // NOTE: touch every page now, as cudaHostAlloc does, so the first copy
    // does not pay page faults inside the emulated link.
    std::memset(p, 0, rounded);
  }
  g_pinned.fetch_add(1);
  return p;
}

void free_pinned(bool cuda, int device, void* p) noexcept {
  (void)device;
  if (p == nullptr) return;
  if (cuda) {
    detail::cuda_free_pinned(p);
  } else {
    std::free(p);
  }
  g_pinned.fetch_sub(1);
}

void register_host(bool cuda, int device, void* p, std::size_t n) {
  (void)device;
  if (p == nullptr || n == 0) throw std::invalid_argument("register_host: empty region");
  if (cuda) detail::cuda_register_host(p, n);
  g_registrations.fetch_add(1);
}

void unregister_host(bool cuda, int device, void* p) noexcept {
  (void)device;
  if (cuda) detail::cuda_unregister_host(p);
  g_registrations.fetch_sub(1);
}

namespace {

using Clock = std::chrono::steady_clock;

class HostBackend final : public CopyBackend {
 public:
  HostBackend(int max_slots, double gbps)
      : bytes_per_s_(gbps > 0 ? gbps * 1e9 : 0.0),
        done_(std::size_t(max_slots), 1),
        results_(std::size_t(max_slots)) {
    engine_ = std::thread([this] { run(); });
    detail::count_thread(+1);
  }
  ~HostBackend() override { close(); }

  const char* name() const override { return "host"; }

  bool enqueue(int slot, void* dst, const void* src, std::size_t n, std::string* err) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      *err = "host backend is closed";
      return false;
    }
    done_[std::size_t(slot)] = 0;
    jobs_.push_back(Job{slot, dst, src, n, Clock::now()});
    work_cv_.notify_one();
    return true;
  }

  bool query(int slot, ChunkResult* out) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done_[std::size_t(slot)]) return false;
    *out = results_[std::size_t(slot)];
    return true;
  }

  void wait_progress(int slot, Clock::time_point deadline,
                     const std::function<bool()>& interrupted) override {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&] { return done_[std::size_t(slot)] || interrupted(); };
    if (deadline == Clock::time_point::max()) {
      done_cv_.wait(lk, ready);
    } else {
      done_cv_.wait_until(lk, deadline, ready);
    }
  }

  void wake() override {
    std::lock_guard<std::mutex> lk(mu_);
    done_cv_.notify_all();
  }

  bool stream_wait_slot(int, std::uintptr_t, std::string* err) override {
    *err = "the host backend has no CUDA streams";
    return false;
  }
  bool supports_stream_wait() const override { return false; }

  void close() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      stop_ = true;
      hold_ = false;
      work_cv_.notify_all();
    }
    engine_.join();
    detail::count_thread(-1);
  }

  bool source_is_pinned(const void*, std::string*) override { return true; }
  bool destination_is_device(void*, std::string*) override { return true; }

  bool set_hold(bool hold) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return false;
    if (hold_ && !hold) released_at_ = Clock::now();
    hold_ = hold;
    work_cv_.notify_all();
    return true;
  }

  bool inject_failures(int count, const std::string& text) override {
    std::lock_guard<std::mutex> lk(mu_);
    fail_next_ = count;
    fail_text_ = text;
    return true;
  }

 private:
  struct Job {
    int slot;
    void* dst;
    const void* src;
    std::size_t n;
    Clock::time_point enqueued;
  };

  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    Clock::time_point link_free = Clock::now();
    while (true) {
      work_cv_.wait(lk, [&] { return (stop_ || !hold_) && (!jobs_.empty() || stop_); });
      if (jobs_.empty()) break;  // stop_ and drained
      Job job = jobs_.front();
      Clock::time_point released_at = released_at_;
      jobs_.pop_front();
      ChunkResult res;
      if (fail_next_ > 0) {
        --fail_next_;
        res.ok = false;
        res.error = fail_text_;
      }
      lk.unlock();
      if (res.ok) {
        // NOTE: a virtual link clock: back-to-back chunks start when the
        // previous one ended on the link (not when this thread woke up), so
        // sleep overshoot does not accumulate into lost bandwidth.
        Clock::time_point start = link_free > job.enqueued ? link_free : job.enqueued;
        if (released_at > start) start = released_at;  // a held link starts on release
        Clock::time_point copy_begin = Clock::now();
        std::memcpy(job.dst, job.src, job.n);
        Clock::duration copy_time = Clock::now() - copy_begin;
        Clock::duration link_time = Clock::duration::zero();
        if (bytes_per_s_ > 0)
          link_time = std::chrono::duration_cast<Clock::duration>(
              std::chrono::duration<double>(double(job.n) / bytes_per_s_));
        // The chunk occupies the link for the longer of the emulated transfer
        // and the memcpy itself; scheduling delays of this thread are not
        // link time (the next queued chunk starts at `end`, virtually).
        Clock::time_point end = start + (copy_time > link_time ? copy_time : link_time);
        std::this_thread::sleep_until(end);
        link_free = end;
        res.busy_s = std::chrono::duration<double>(end - start).count();
      }
      lk.lock();
      results_[std::size_t(job.slot)] = std::move(res);
      done_[std::size_t(job.slot)] = 1;
      done_cv_.notify_all();
    }
  }

  double bytes_per_s_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> jobs_;
  std::vector<std::uint8_t> done_;
  std::vector<ChunkResult> results_;
  bool stop_ = false;
  bool hold_ = false;
  Clock::time_point released_at_{};
  int fail_next_ = 0;
  std::string fail_text_;
  std::thread engine_;
};

}  // namespace

std::unique_ptr<CopyBackend> make_host_backend(int max_slots, double emulated_link_gbps) {
  return std::unique_ptr<CopyBackend>(new HostBackend(max_slots, emulated_link_gbps));
}

}  // namespace pdflash
