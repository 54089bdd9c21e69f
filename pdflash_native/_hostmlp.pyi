# Hand-written stub for pdflash_native/_hostmlp.pyx (checked by stubtest).
import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

ACT_SWIGLU_SILU: int
ACT_GPT_OSS_CLAMP: int
ISA_AUTO: int
ISA_SCALAR: int
ISA_AVX512_BF16: int
ISA_AMX_BF16: int
ISA_NAMES: dict[int, str]
DTYPE_F32: int
DTYPE_BF16: int
WEIGHTS_BF16: int
WEIGHTS_MXFP4: int
WEIGHTS_FP8: int
TILE_COLS: int
W1_TILE_INTER: int

def cpu_has_avx512_bf16() -> bool: ...
def cpu_has_amx_bf16() -> bool: ...
def inter_pad(inter: int) -> int: ...
def hidden_pairs(hidden: int) -> int: ...
def w1_elems(hidden: int, inter: int) -> int: ...
def w2_elems(hidden: int, inter: int) -> int: ...
def mxfp4_code_bytes(elems: int) -> int: ...
def mxfp4_scale_bytes(elems: int) -> int: ...
def w1_tiles(inter: int) -> int: ...
def w2_tiles(hidden: int) -> int: ...

@disjoint_base
class HostMlp:
    threads: int
    spin_us: int
    def __init__(self, threads: int, spin_us: int = 50) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def calls(self) -> int: ...
    @property
    def last_isa(self) -> int: ...
    @property
    def worker_tids(self) -> list[int]: ...
    def close(self) -> None: ...
    def run(
        self,
        act: int,
        hidden: int,
        inter: int,
        alpha: float,
        limit: float,
        w1: npt.NDArray[np.uint64],
        b1: npt.NDArray[np.uint64],
        w2: npt.NDArray[np.uint64],
        b2: npt.NDArray[np.uint64],
        bounds: npt.NDArray[np.int64],
        x: int,
        x_type: int,
        x_stride: int,
        out: int,
        out_type: int,
        out_stride: int,
        isa: int = 0,
        amx_min_rows: int = 1,
        weights: int = 0,
        q1: npt.NDArray[np.uint64] | None = None,
        s1: npt.NDArray[np.uint64] | None = None,
        q2: npt.NDArray[np.uint64] | None = None,
        s2: npt.NDArray[np.uint64] | None = None,
    ) -> None: ...
