# cdef extern declarations of the host-to-stream signals (cuda/include/pdflash/host_signal.h).
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libcpp.string cimport string


cdef extern from "pdflash/host_signal.h" namespace "pdflash" nogil:
    cdef enum class WaitOutcome(uint32_t):
        kNone
        kDone
        kFailed
        kTimedOut

    cdef cppclass SignalTicket:
        int slot
        uint32_t seq

    cdef cppclass HostSignalRing:
        HostSignalRing(int capacity, bint mapped, int device) except +
        SignalTicket acquire(uint64_t reuse_wait_ns) except +
        void signal(int slot, uint32_t seq, bint failed) except +
        void unmap() except +
        void enqueue_wait(int slot, uint32_t seq, uintptr_t stream, uint64_t timeout_ns) except +
        WaitOutcome wait_host(int slot, uint32_t seq, uint64_t timeout_ns) except +
        WaitOutcome error_code()
        uint32_t error_seq()
        uint32_t flag(int slot) except +
        uint32_t ack(int slot) except +
        int capacity()
        bint mapped()
        uint64_t launches()

    uint32_t signal_value(uint32_t seq, bint failed)
    uint32_t next_signal_seq(uint32_t seq)
    bint host_signal_has_cuda()
    string host_signal_unavailable(int device)
