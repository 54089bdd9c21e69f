# Build facts baked in at compile time (no runtime probing here).
cdef extern from *:
    """
    #ifndef PDFLASH_WITH_CUDA
    #define PDFLASH_WITH_CUDA 0
    #endif
    """
    int PDFLASH_WITH_CUDA
