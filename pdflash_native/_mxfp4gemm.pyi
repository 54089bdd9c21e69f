# Hand-written stub for pdflash_native/_mxfp4gemm.pyx (checked by stubtest).

BUILT: bool
WGMMA_BUILT: bool
OK: int
BAD_VARIANT: int
BAD_ARGS: int
BLOCK_M_TOO_LARGE: int
BLOCK_M_VARIANT: int
NOT_BUILT: int
VARIANT_UNAVAILABLE: int
ATTRIBUTE_ERROR: int
LAUNCH_ERROR: int
KIND_MMA_SYNC: int
KIND_WGMMA: int
KIND_WGMMA_PX: int
KIND_WGMMA_RC: int
OUT_NATURAL: int
OUT_CHUNK_PERMUTED: int

def num_variants() -> int: ...
def variant_info(variant: int) -> tuple[int, int, int, int, int, int]: ...
def variant_available(variant: int, device: int) -> int: ...
def error_string(code: int) -> str: ...
def launch(
    variant: int,
    x: int,
    stride_xm: int,
    x_rows: int,
    blocks: int,
    stride_ws: int,
    stride_wn: int,
    stride_wc: int,
    scales: int,
    stride_ss: int,
    stride_sn: int,
    stride_sk: int,
    bias: int,
    stride_bs: int,
    out: int,
    stride_om: int,
    tile_slot: int,
    tile_start: int,
    tile_end: int,
    num_tiles: int,
    block_m: int,
    n: int,
    k: int,
    n_out: int,
    act: int,
    gate_col0: int,
    up_col0: int,
    col_step: int,
    alpha: float,
    limit: float,
    out_layout: int,
    stream: int,
) -> int: ...
