# cdef extern declarations of the C++ issuer (cuda/include/pdflash/*.h).
# Kept apart from the wrapper's .pxd (RMM style): this file only mirrors the
# headers, _issuer.pxd/.pyx/.pyi are the Python-facing module.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector


cdef extern from "pdflash/copy_backend.h" namespace "pdflash" nogil:
    cdef cppclass LiveCounts:
        int64_t issuers
        int64_t threads
        int64_t pinned_allocations
        int64_t registrations

    LiveCounts live_counts()
    int cuda_device_count()
    bool built_with_cuda()
    void* alloc_pinned(bool cuda, int device, size_t n) except +
    void free_pinned(bool cuda, int device, void* p)
    void register_host(bool cuda, int device, void* p, size_t n) except +
    void unregister_host(bool cuda, int device, void* p)


cdef extern from "pdflash/issuer.h" namespace "pdflash" nogil:
    cdef int kNumBands
    cdef uint64_t kNoKey

    cdef cppclass IssuerConfig:
        bool use_cuda
        int device
        size_t chunk_bytes
        size_t window_bytes
        int max_inflight_chunks
        double issue_lead_s
        double emulated_link_gbps
        bool debug_log

    cdef cppclass LogEvent:
        double t_s
        int32_t kind
        int32_t band
        int64_t ticket
        int64_t chunk
        int64_t bytes
        int32_t ok

    cdef cppclass BandStats:
        uint64_t copies
        uint64_t bytes
        uint64_t submitted
        uint64_t dedup_hits
        uint64_t promotions
        uint64_t cancellations
        uint64_t failures
        double blocked_wait_s
        uint64_t delay_samples
        double queue_delay_p50_s
        double queue_delay_p99_s

    cdef cppclass IssuerStats:
        BandStats bands[3]
        double link_busy_s
        double uptime_s
        uint64_t chunks
        uint64_t queued_copies
        uint64_t queued_bytes
        uint64_t inflight_chunks
        uint64_t inflight_bytes
        double link_rate_estimate_bps
        uint64_t submit_calls
        double submit_lock_wait_s
        double submit_locked_s

    cdef cppclass LinkState:
        uint64_t queued_copies
        uint64_t inflight_chunks
        double link_rate_estimate_bps

    cdef cppclass WaitResult:
        int code
        int64_t ticket
        string message

    cdef cppclass Issuer:
        Issuer(const IssuerConfig& config) except +
        const char* backend_name()
        int64_t worker_tid()
        void submit(const int64_t* src, const int64_t* dst, const int64_t* nbytes,
                    size_t nbytes_stride, const uint64_t* keys, size_t n, int band,
                    int64_t* tickets_out) except +
        void states(const int64_t* tickets, size_t n, uint8_t* out) except +
        WaitResult wait(const int64_t* tickets, size_t n, double timeout_s) except +
        WaitResult stream_wait(const int64_t* tickets, size_t n, uintptr_t stream,
                               double timeout_s) except +
        int64_t cancel(int band) except +
        void cancel_unstarted(const int64_t* tickets, size_t n, uint8_t* out) except +
        IssuerStats stats()
        LinkState link_state()
        vector[LogEvent] debug_log()
        void add_source_region(uintptr_t begin, size_t n, bool check_pinned) except +
        void add_destination_region(uintptr_t begin, size_t n, bool check_device) except +
        int64_t release_region(uintptr_t begin, size_t n) except +
        int64_t remove_source_region(uintptr_t begin, size_t n) except +
        int64_t remove_destination_region(uintptr_t begin, size_t n) except +
        bool test_hold_link(bool hold)
        bool test_inject_failures(int count, const string& text)
        void shutdown()
        bool closed()
