from libc.stdint cimport int64_t, uintptr_t

from pdflash_native._issuer_cpp cimport Issuer


cdef class NativeIssuer:
    cdef Issuer* _issuer
    cdef Issuer* _live(self) except NULL
    cdef readonly bint use_cuda
    cdef readonly int device
    cdef dict _registered  # register_host: ptr -> nbytes
    cdef dict _sources  # register_source: ptr -> nbytes
    cdef dict _destinations  # register_destination: ptr -> nbytes
    cdef object __weakref__
    cdef _add_region(self, bint source, uintptr_t ptr, size_t nbytes)
    cdef int64_t _remove_region(self, bint source, uintptr_t ptr) except -1


cdef class PinnedBuffer:
    cdef void* _ptr
    cdef size_t _nbytes
    cdef bint _cuda
    cdef int _device
    cdef int _exports
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef object __weakref__
    cdef object _release  # callable(ptr, nbytes) run before the memory is freed
    cdef void _free(self) noexcept
