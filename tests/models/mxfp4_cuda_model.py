"""CPU model of the CUDA MXFP4 GEMM (``cuda/src/mxfp4_moe_gemm.cu``): the
pure-Python reference of its per-lane algorithm, run by
``tests/models/test_mxfp4_cuda_model.py`` (the kernel itself is compared with
torch on the GPU in ``tests/models/test_mxfp4_cuda_gemm_gpu.py``).

Runs the kernel's per-lane arithmetic literally (no GPU): which lane loads
which weight bytes (cp.async slot = block ``4c + t`` of rows ``g`` / ``g + 8``
of each m-tile), which scale byte it reads from the staged scale rows, the
bf16 bits its dequant builds (``e2m1_pair_bits`` + the bf16x2 multiplies,
rounded as bf16), the permuted + XOR-swizzled shared tile of the activations
(``store_x``) and the B fragment each lane reads from it (``boff``), the
``mma.m16n8k16`` fragment layouts of the PTX ISA (A: row ``g`` for a0,a1,a4,a5
and ``g + 8`` for a2,a3,a6,a7, col ``2t + (i & 1) (+ 8 for i >= 4)``; B: row
``2t + (i & 1) (+ 8 for i >= 2)``, col ``g``; C/D: row ``g`` (c0, c1) / ``g + 8``
(c2, c3), col ``2t + (i & 1)``), the per-CTA scale range decision (fast:
one multiply by ``2^(s-1-D)``, ``2^D`` on the accumulator; slow: ``2^126`` then
``2^(s-127)``) and the epilogue's row / column mapping. The product is
accumulated in float64 and compared with a float64 reference (dequantize,
matmul, bias, epilogue): any permutation or fragment bug shows as a large
error; fp64 summation order alone stays ~1e-12. Also checks that the fast
path's products are exact bf16 normals and that the shared-memory accesses of
a quarter warp (B reads, x writes, scale bytes) hit distinct banks.

Epilogues: ``act`` 0 (none), 1 (gpt-oss clamped SwiGLU), 2 (silu(gate) *
up), as the kernel's ``Params.act``.

The wgmma kind (cfg (WARPS, MT, NSM, KIND_WGMMA)): the same lanes, dequant
and epilogue; x staged per k-step ``ks = 2w + h`` as core matrices (8 tokens
x 16 bytes) at ``ks * (XTOK * 32 + 16) + (tok >> 3) * SBO + half * LBO +
(tok & 7) * 16`` (``store_x``'s wgmma branch, literally), B read through the
matrix descriptor the kernel builds (``smem_desc``, decoded with PTX's K-major
no-swizzle rule: core matrix (k // 8, n // 8) at start + (k // 8) * LBO +
(n // 8) * SBO), and per warp each 8-token piece of the m64nNk16 product is
an m16n8k16 with mma.sync's A / D fragments (the accumulators ``d[4 ns +
e]`` = the kernel's ``acc[0][ns][e]``). The layout pieces are module
functions, so tests can mutate each one and see the comparison fail.

The wgmma kind with x given chunk-permuted (cfg (..., KIND_WGMMA_PX)): the
same, x staged by ``issue_x``'s cp.async units from the permuted rows
(:func:`chunk_permuted_bits`, the header's formula elementwise) into the same
core-matrix offsets; a partial chunk's units hold 4 bytes per live 32-k block,
zero-filled after.

The kind KIND_WGMMA_RC has the wgmma kind's lanes and layouts; it changes
only the dequant's bit extraction (modelled by the repacked-word tests), and
its GPU test compares it with variant 10 bit for bit.

    python tests/models/mxfp4_cuda_model.py
"""

from __future__ import annotations

import sys

import numpy as np

M32 = 0xFFFFFFFF
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------ bf16 helpers
def bf16_value(bits: int) -> float:
    """The value of a bf16 bit pattern (subnormals, inf, NaN)."""
    bits &= 0xFFFF
    sign = -1.0 if bits >> 15 else 1.0
    exp, mant = (bits >> 7) & 0xFF, bits & 0x7F
    if exp == 0xFF:
        return sign * np.inf if mant == 0 else np.nan
    if exp == 0:
        return sign * mant * 2.0**-133
    return sign * (1 + mant / 128) * 2.0 ** (exp - 127)


def bf16_bits(v: float) -> int:
    """Round-to-nearest-even bf16 bits of ``v`` (through fp32: the products
    here are exact in fp32 or overflow)."""
    with np.errstate(over="ignore"):
        f = np.float32(v)
    b = int(np.array([f], dtype=np.float32).view(np.uint32)[0])
    if (b >> 23) & 0xFF == 0xFF:  # inf / NaN: keep
        return (b >> 16) | (0x40 if (b & 0x7FFFFF) else 0)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def bf16x2_mul(a: int, b: int) -> int:
    lo = bf16_bits(bf16_value(a) * bf16_value(b))
    hi = bf16_bits(bf16_value(a >> 16) * bf16_value(b >> 16))
    return lo | (hi << 16)


def halves(reg: int) -> tuple[float, float]:
    return bf16_value(reg), bf16_value(reg >> 16)


# ------------------------------------------------------------ kernel pieces
def e2m1_pair_bits_v1(q: int, i: int) -> int:
    """The first formulation (shifts and masks), kept to check the kernel's."""
    if i == 0:
        em, sg = (q & 0x00070007) << 6, (q << 12) & 0x80008000
    elif i == 1:
        em, sg = (q & 0x00700070) << 2, (q << 8) & 0x80008000
    elif i == 2:
        em, sg = (q & 0x07000700) >> 2, (q << 4) & 0x80008000
    else:
        em, sg = (q & 0x70007000) >> 6, q & 0x80008000
    return (em | sg) & M32


def e2m1_pair_bits(q: int, i: int) -> int:
    """The kernel's formulation (uint32 arithmetic: products wrap)."""
    if i == 0:
        em, sg_src = ((q & 0x00070007) * 64) & M32, (q * 4096) & M32
    elif i == 1:
        em, sg_src = ((q & 0x00700070) * 4) & M32, (q * 256) & M32
    elif i == 2:
        em, sg_src = (((q >> 8) & 0x00070007) * 64) & M32, (q * 16) & M32
    else:
        em, sg_src = (((q >> 8) & 0x00700070) * 4) & M32, q
    return (em | (sg_src & 0x80008000)) & M32


def check_pair_bits(rng) -> bool:
    """Both formulations agree, and give value * 2^-126 for every nibble."""
    qs = [int(v) for v in rng.integers(0, 2**32, 20000, dtype=np.uint64)] + [
        0,
        M32,
        0x88888888,
        0x77777777,
    ]
    for q in qs:
        for i in range(4):
            r = e2m1_pair_bits(q, i)
            if r != e2m1_pair_bits_v1(q, i):
                return False
            for h, nib in ((0, (q >> (4 * i)) & 0xF), (16, (q >> (4 * i + 16)) & 0xF)):
                want = (-1 if nib & 8 else 1) * FP4[nib & 7] * 2.0**-126
                if bf16_value(r >> h) != want:
                    return False
    return True


def rotr32(q: int, n: int) -> int:
    return ((q >> n) | (q << (32 - n))) & M32


def repack_word(q: int, table) -> int:
    """A natural 32-bit code word repacked: natural nibble i's bit b goes to
    bit ``table[i][b]`` (the header's PDFLASH_MXFP4_KIND_WGMMA_RC table)."""
    out = 0
    for i, targets in enumerate(table):
        for b, target in enumerate(targets):
            out |= ((q >> (4 * i + b)) & 1) << target
    return out


def repacked_pair_bits(q: int, i: int) -> int:
    """The kernel's ``repacked_pair_bits<I>`` (a repacked word): rotations
    and masks only."""
    if i == 0:
        return q & 0x81C081C0
    if i == 1:
        return rotr32(q, 4) & 0x81C081C0
    if i == 2:
        return rotr32(q, 10) & 0x81C081C0
    return (rotr32(q, 30) & 0x80C080C0) | (rotr32(q, 6) & 0x01000100)  # rotl 2, rotr 6


def check_repacked_pair_bits(rng, table) -> bool:
    """Each pair's bits from the repacked word equal ``e2m1_pair_bits`` of
    the natural word, for random words, the corner patterns, and every value
    of each pair's two nibbles (amid random others): exhaustive per pair."""
    qs = [int(v) for v in rng.integers(0, 2**32, 20000, dtype=np.uint64)]
    qs += [0, M32, 0x88888888, 0x77777777] + [1 << b for b in range(32)]
    for i in range(4):
        keep = M32 ^ ((0xF << (4 * i)) | (0xF << (4 * i + 16)))
        for lo in range(16):
            for hi in range(16):
                other = int(rng.integers(0, 2**32, dtype=np.uint64)) & keep
                qs.append(other | (lo << (4 * i)) | (hi << (4 * i + 16)))
    for q in qs:
        r = repack_word(q, table)
        for i in range(4):
            if repacked_pair_bits(r, i) != e2m1_pair_bits(q, i):
                return False
    return True


def e8m0_bf16x2(s: int) -> int:
    b = 0x0040 if s == 0 else (s << 7)
    return (b * 0x00010001) & M32


def dequant_pair(q: int, i: int, f: int, slow: bool, exact_check: list) -> int:
    bits = e2m1_pair_bits(q, i)
    if slow:
        return bf16x2_mul(bf16x2_mul(bits, 0x7E807E80), f)
    out = bf16x2_mul(bits, f)
    # fast path: the product must be exact (no rounding) and normal or zero
    for h in (0, 16):
        y, fv = bf16_value(bits >> h), bf16_value(f >> h)
        r = (out >> h) & 0xFFFF
        if bf16_value(r) != y * fv or (((r >> 7) & 0xFF) == 0 and (r & 0x7F) != 0):
            exact_check.append((q, i, f))
    return out


def weight_row(p: dict, mtile: int, g: int, r: int) -> int:
    if p["act"]:
        j = mtile * 8 + g
        if j >= p["n_out"]:
            return -1
        row = (p["g0"] if r == 0 else p["u0"]) + j * p["step"]
        return row if row < p["N"] else -1
    row = mtile * 16 + g + 8 * r
    return row if row < p["N"] else -1


def mma(d: np.ndarray, a_regs: list, b_regs: list) -> None:
    """``d[lane][0..3] += A @ B`` for one warp from per-lane registers
    (a_regs[lane] = 4 bf16x2, b_regs[lane] = 2 bf16x2), PTX m16n8k16 layouts."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        elems = [v for reg in a_regs[lane] for v in halves(reg)]  # a0..a7
        for i, v in enumerate(elems):
            row = g if (i < 2 or 4 <= i < 6) else g + 8
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            assert np.isnan(A[row, col])
            A[row, col] = v
        belems = [v for reg in b_regs[lane] for v in halves(reg)]  # b0..b3
        for i, v in enumerate(belems):
            row = 2 * t + (i & 1) + (8 if i >= 2 else 0)
            B[row, g] = v
    assert not np.isnan(A).any() or True
    with np.errstate(invalid="ignore", over="ignore"):
        D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            row = g if i < 2 else g + 8
            col = 2 * t + (i & 1)
            d[lane][i] += D[row, col]


# ------------------------------------------------------------ wgmma kind
#: Cfg::KIND values
KIND_MMA_SYNC, KIND_WGMMA, KIND_WGMMA_PX = 0, 1, 2
#: the kernel's kWgmmaLboBytes / kWgmmaSboBytes: the B core matrices (8 tokens
#: x 16 bytes) of k half kh are kh * LBO apart, of token group n / 8 n // 8 * SBO
WGMMA_LBO, WGMMA_SBO = 128, 256


def wgmma_region_bytes(xtok: int) -> int:
    """Cfg::XREG_BYTES: one k-step's x region (XTOK * 32) + 16 bytes of bank spread."""
    return xtok * 32 + 16


def smem_desc(addr: int) -> int:
    """The kernel's smem_desc: start address >> 4 in bits 0..13, LBO >> 4 in
    16..29, SBO >> 4 in 32..45 (no swizzle, base offset 0)."""
    return ((addr & 0x3FFFF) >> 4) | ((WGMMA_LBO >> 4) << 16) | ((WGMMA_SBO >> 4) << 32)


def wgmma_desc(xbuf_addr: int, ks: int, xreg: int) -> int:
    """The descriptor of k-step ``ks``: the chunk's x buffer descriptor plus
    the region offset >> 4 (as the kernel adds it to the 64-bit descriptor)."""
    return smem_desc(xbuf_addr) + ((ks * xreg) >> 4)


def wgmma_b_address(desc: int, kk: int, n: int) -> int:
    """Shared-memory byte address of B element (k = kk, token column n) that
    wgmma reads through ``desc`` (PTX: K-major, no swizzle; core matrix
    (kk // 8, n // 8) at start + (kk // 8) * LBO + (n // 8) * SBO, rows of 16
    bytes per token, 2 bytes per k)."""
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    return start + (kk >> 3) * lbo + (n >> 3) * sbo + (n & 7) * 16 + (kk & 7) * 2


def wgmma_x_store_offset(ks: int, half: int, tok: int, xreg: int) -> int:
    """store_x (wgmma): byte offset in the x buffer of token ``tok``'s 16 bytes
    of k-step ``ks``, k half ``half``."""
    return ks * xreg + (tok >> 3) * WGMMA_SBO + half * WGMMA_LBO + (tok & 7) * 16


def wgmma_x_store_values(v: list, h: int, half: int) -> list:
    """store_x (wgmma): the 8 bf16 of (k-step 2w + h, k half ``half``) from
    ``v[t]`` = x[k0 + 32 t + 8 w .. + 7]: the pairs (x[32 t + 8 w + 2 h +
    half], x[.. + 4]) for t = 0..3 (prmt 0x5410 / 0x7632 of words h, h + 2)."""
    vals = []
    for t in range(4):
        vals += [v[t][2 * h + half], v[t][2 * h + 4 + half]]
    return vals


def chunk_permuted_position(k_in: int) -> int:
    """Where the header's chunk-permuted layout (kind 2) puts input k_in =
    32 t + 8 w + 4 e + 2 h + d of a 128-element chunk: 32 w + 16 h + 8 d +
    2 t + e."""
    t, w, e, h, d = k_in >> 5, (k_in >> 3) & 3, (k_in >> 2) & 1, (k_in >> 1) & 1, k_in & 1
    return 32 * w + 16 * h + 8 * d + 2 * t + e


def chunk_permuted_bits(x_bits: np.ndarray) -> np.ndarray:
    """x [rows, K] (bf16 bits) in the chunk-permuted layout: [rows, NC *
    128], zeros past K (elementwise from :func:`chunk_permuted_position`)."""
    rows, K = x_bits.shape
    nc = -(-K // 128)
    out = np.zeros((rows, nc * 128), dtype=x_bits.dtype)
    for k in range(K):
        out[:, (k // 128) * 128 + chunk_permuted_position(k % 128)] = x_bits[:, k]
    return out


def stage_x_wgmma_px(xbuf, written, xp_bits, s_xrow, nrows, nsl, c, K, THREADS, XU,
                     XUNITS, XREG) -> None:  # fmt: skip
    """issue_x (kind 2): unit id = tid + i * THREADS -> token id >> 4, unit
    u = id & 15 = 2 ks + d: 16 bytes of the chunk-permuted row at 128 c + 8 u
    (4 bytes per live 32-k block of the chunk, the rest zero; tokens of the
    live sub-tiles past nrows all zero) into the core-matrix layout."""
    live_blocks = min(4, (K - 128 * c) >> 5)
    for tid in range(THREADS):
        for i in range(XU):
            uid = tid + i * THREADS
            tok, u = uid >> 4, uid & 15
            if uid >= XUNITS or tok >= nsl * 8:
                continue
            unit = np.zeros(8, dtype=np.uint16)
            if tok < nrows:
                src = xp_bits[s_xrow[tok], 128 * c + 8 * u : 128 * c + 8 * u + 8]
                unit[: 2 * live_blocks] = src[: 2 * live_blocks]  # src-size 4 * live_blocks
            off = wgmma_x_store_offset(u >> 1, u & 1, tok, XREG)
            assert off % 16 == 0 and off + 16 <= len(xbuf) and not written[off // 16]
            written[off // 16] = True
            xbuf[off : off + 16] = unit.view(np.uint8)


def wgmma_acc_index(ns: int, e: int) -> int:
    """WgmmaM64's d[] index of accumulator e of sub-tile ns (d = &acc[0][0][0]:
    acc[0][ns][e])."""
    return 4 * ns + e


def stage_x_mma(xbuf, written, bank_log, where, x_bits, s_xrow, nrows, nsl, k0, K,
                THREADS, XU, XUNITS) -> None:  # fmt: skip
    """store_x (mma.sync): 16-byte unit u of token tok, permuted x0 x4 x1 x5
    x2 x6 x3 x7 (prmt), at tok * 256 + (u XOR-swizzled) * 16."""
    for tid in range(THREADS):
        phase_units = []
        for i in range(XU):
            uid = tid + i * THREADS
            tok, u = uid >> 4, uid & 15
            if not (uid < XUNITS and tok < nsl * 8):
                continue
            vals = [0] * 8
            if tok < nrows and k0 + 8 * u < K:
                vals = [int(v) for v in x_bits[s_xrow[tok], k0 + 8 * u : k0 + 8 * u + 8]]
            # words w0..w3 = (x0,x1) (x2,x3) (x4,x5) (x6,x7); prmt as in store_x
            perm = [vals[0], vals[4], vals[1], vals[5], vals[2], vals[6], vals[3], vals[7]]
            phys = u ^ (((u >> 3) & 1) << 1) ^ (tok & 1)
            off = tok * 256 + phys * 16
            assert not written[off // 16]
            written[off // 16] = True
            xbuf[off : off + 16] = np.array(perm, dtype=np.uint16).view(np.uint8)
            phase_units.append((i, off))
        for i, off in phase_units:
            bank_log.append(("xw", *where, i, tid, (off // 16) % 8))


def stage_x_wgmma(p, xbuf, written, bank_log, where, x_bits, s_xrow, nrows, nsl, k0,
                  THREADS, XU, XTOK, XREG) -> None:  # fmt: skip
    """store_x (wgmma): unit id = tid + i * THREADS -> token id >> 2, word w =
    id & 3; its 4 x 16 bytes (k-steps 2w, 2w + 1, both k halves) into the
    core-matrix layout (:func:`wgmma_x_store_offset`)."""
    K = p["K"]
    for tid in range(THREADS):
        for i in range(XU):
            uid = tid + i * THREADS
            tok, w = uid >> 2, uid & 3
            if not (uid < XTOK * 4 and tok < nsl * 8):
                continue
            v = []  # v[t] = x[k0 + 32 t + 8 w .. + 7] (load_x)
            for t in range(4):
                k = k0 + 32 * t + 8 * w
                ok = tok < nrows and k < K
                v.append([int(q) for q in x_bits[s_xrow[tok], k : k + 8]] if ok else [0] * 8)
            for h in range(2):
                for half in range(2):
                    off = wgmma_x_store_offset(2 * w + h, half, tok, XREG)
                    assert off % 16 == 0 and off + 16 <= len(xbuf) and not written[off // 16]
                    written[off // 16] = True
                    vals = wgmma_x_store_values(v, h, half)
                    xbuf[off : off + 16] = np.array(vals, dtype=np.uint16).view(np.uint8)
                    bank_log.append(("xw", *where, (i, h, half), tid, (off // 16) % 8))


def wgmma_warp(acc_flat, warp, a, w, xbuf, written, xbuf_addr, nsl, XREG) -> None:
    """One warp's share of the wgmmas of k-steps 2w, 2w + 1 (m64nNk16, N = 8
    nsl): its 16 rows times B as the descriptor addresses it, accumulated
    into d[] = the flat accumulators (:func:`wgmma_acc_index`). Per 8 token
    columns the A / D fragments are mma.m16n8k16's, so each 8-column piece is
    :func:`mma` with B registers gathered from the descriptor's addresses."""
    for h in range(2):
        ks = 2 * w + h
        desc = wgmma_desc(xbuf_addr, ks, XREG)
        for ns in range(nsl):
            b = {}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                n = 8 * ns + g
                regs = []
                for kk in (2 * t, 2 * t + 8):  # b0/b1: k 2t, 2t+1; b2/b3: k 2t+8, 2t+9
                    off = wgmma_b_address(desc, kk, n) - xbuf_addr
                    assert off >= 0 and off + 4 <= len(xbuf), "wgmma reads outside the x buffer"
                    assert written[off // 16], "wgmma reads an unstaged x unit"
                    regs.append(int(xbuf[off : off + 4].view(np.uint32)[0]))
                b[lane] = regs
            idx = [wgmma_acc_index(ns, e) for e in range(4)]
            d = [np.zeros(4) for _ in range(32)]
            mma(d, [a[lane, h, 0] for lane in range(32)], [b[lane] for lane in range(32)])
            for lane in range(32):
                acc_flat[warp * 32 + lane, idx] += d[lane]


def run_model(
    prob: dict, cfg: tuple[int, ...], bank_log: list, exact_log: list, path_log: list
) -> np.ndarray:
    """The kernel over every CTA; returns out [rows, n_out] (NaN = unset).
    ``cfg``: (WARPS, MT, NSM) or (WARPS, MT, NSM, KIND)."""
    WARPS, MT, NSM = cfg[:3]
    KIND = cfg[3] if len(cfg) > 3 else KIND_MMA_SYNC
    assert KIND == KIND_MMA_SYNC or (MT == 1 and WARPS % 4 == 0)
    wgmma = KIND in (KIND_WGMMA, KIND_WGMMA_PX)
    THREADS = WARPS * 32
    p = prob
    K, N = p["K"], p["N"]
    KB = K // 32
    NC = (KB + 3) // 4
    XTOK = NSM * 8
    XUNITS = XTOK * 16
    XU = -(-(XTOK * 4) // THREADS) if KIND == KIND_WGMMA else -(-XUNITS // THREADS)
    XREG = wgmma_region_bytes(XTOK)
    XBUF_BYTES = XTOK * 256 if KIND == KIND_MMA_SYNC else 8 * XREG
    NXB = {KIND_MMA_SYNC: 2, KIND_WGMMA: 3, KIND_WGMMA_PX: 4}[KIND]  # (PX: STAGES 4)
    WBUF_BYTES = 4 * MT * 2 * THREADS * 16  # (any ring depth: only the x buffer's base matters)
    blocks, scales, x, x_rows, bias = p["blocks"], p["scales"], p["x"], p["x_rows"], p["bias"]
    # out_column: the epilogue's out_column (out_perm: the chunk-permuted
    # layout, rows of ceil(n_out / 128) * 128 positions)
    out_perm = bool(p.get("out_perm"))
    width = -(-p["n_out"] // 128) * 128 if out_perm else p["n_out"]
    out = np.full((len(x_rows), width), np.nan)

    def out_column(j: int) -> int:
        return j - j % 128 + chunk_permuted_position(j % 128) if out_perm else j

    cols_per_cta = WARPS * MT * (8 if p["act"] else 16)
    grid_y = -(-p["n_out"] // cols_per_cta)
    x_bits = x.view(np.uint16)
    xp_bits = chunk_permuted_bits(x_bits) if KIND == KIND_WGMMA_PX else None
    for tile in range(len(p["tile_slot"])):
        slot = int(p["tile_slot"][tile])
        if slot < 0:
            continue
        start, end = int(p["tile_start"][tile]), int(p["tile_end"][tile])
        nrows = min(p["block_m"], end - start)
        if nrows <= 0:
            continue
        assert nrows <= XTOK
        nsl = (nrows + 7) >> 3
        s_xrow = [int(x_rows[start + i]) if i < nrows else 0 for i in range(XTOK)]
        for by in range(grid_y):
            # ---- scale staging and the CTA's scale range (as the kernel)
            WR = WARPS * MT * 16
            row_lo = by * WR
            rows_contig = p["act"] == 0 or (p["step"] == 2 and {p["g0"], p["u0"]} == {0, 1})
            contig = rows_contig  # numpy scales are dense: stride_sn == KB
            if contig:  # shared = the CTA's global scale rows [row_lo, row_lo + rows), pitch KB
                rows = min(WR, N - row_lo)
                s_scale = scales[slot, row_lo : row_lo + max(rows, 0)].reshape(-1).astype(np.int64)
                scale_len = max(rows, 0) * KB
            else:  # shared row (warp * MT + mt) * 16 + m16, pad 127
                s_scale = np.full(WR * KB, -1, dtype=np.int64)
                for warp in range(WARPS):
                    mtile0 = by * WARPS * MT + warp * MT
                    for rr in range(MT * 16):
                        mt, m16 = rr >> 4, rr & 15
                        row = weight_row(p, mtile0 + mt, m16 & 7, m16 >> 3)
                        base = ((warp * MT + mt) * 16 + m16) * KB
                        s_scale[base : base + KB] = scales[slot, row] if row >= 0 else 127
                scale_len = WR * KB
            smin = int(s_scale[:scale_len].min()) if scale_len else 255
            smax = int(s_scale[:scale_len].max()) if scale_len else 0
            D = smax - 128 if smax > 128 else 0
            fast = smin >= D + 2 and smax <= 252 and (D == 0 or smax - smin <= 64)
            if not fast:
                D = 0
            path_log.append(("fast" if fast else "slow", D))
            # ---- per-thread state
            acc = np.zeros((THREADS, MT, NSM, 4))
            acc_flat = acc.reshape(THREADS, MT * NSM * 4)  # the kernel's &acc[0][0][0]
            for c in range(NC):
                xbuf = np.full(XBUF_BYTES, 0xFF, dtype=np.uint8)  # unwritten = NaN bf16
                written = np.zeros(XBUF_BYTES // 16, dtype=bool)
                k0 = 128 * c
                if KIND == KIND_WGMMA_PX:
                    stage_x_wgmma_px(xbuf, written, xp_bits, s_xrow, nrows, nsl, c, K,
                                     THREADS, XU, XUNITS, XREG)  # fmt: skip
                elif KIND == KIND_WGMMA:
                    stage_x_wgmma(p, xbuf, written, bank_log, (tile, by, c), x_bits, s_xrow,
                                  nrows, nsl, k0, THREADS, XU, XTOK, XREG)  # fmt: skip
                else:
                    stage_x_mma(xbuf, written, bank_log, (tile, by, c), x_bits, s_xrow,
                                nrows, nsl, k0, K, THREADS, XU, XUNITS)  # fmt: skip
                xbuf_addr = WBUF_BYTES + (c % NXB) * XBUF_BYTES  # (shared-memory address)
                for warp in range(WARPS):
                    mtile0 = by * WARPS * MT + warp * MT
                    warp_live = any(weight_row(p, mtile0 + mt, 0, 0) >= 0 for mt in range(MT))
                    if not warp_live and KIND == KIND_MMA_SYNC:
                        continue  # (wgmma: the whole warpgroup runs; dead rows are zeros)
                    # per lane: weight words (cp.async slot) and factors
                    wq = {}
                    fac = {}
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        blk = 4 * c + t
                        for mt in range(MT):
                            for r in range(2):
                                row = weight_row(p, mtile0 + mt, g, r)
                                ok = row >= 0 and blk < KB
                                by16 = blocks[slot, row, blk] if ok else np.zeros(16, np.uint8)
                                wq[lane, mt, r] = [int(v) for v in by16.view(np.uint32)]
                                if contig:
                                    soff = (0 if row < 0 else row - row_lo) * KB
                                else:
                                    soff = ((warp * MT + mt) * 16 + g + 8 * r) * KB
                                s = int(s_scale[soff + blk]) if blk < KB else 127
                                assert 0 <= s <= 255
                                bank_log.append(
                                    ("sc", tile, by, c, warp, mt, r, lane, (soff + blk) // 4)
                                )
                                if fast:
                                    fac[lane, mt, r] = (((s + 126 - D) << 7) * 0x00010001) & M32
                                else:
                                    fac[lane, mt, r] = e8m0_bf16x2(s)
                    for w in range(4):
                        # A of k-steps 2w (h = 0) and 2w + 1 (h = 1): regs (row g, row g+8,
                        # row g, row g+8) = pairs (2h, 2h, 2h+1, 2h+1) (both kinds)
                        a = {}
                        for lane in range(32):
                            for mt in range(MT):
                                q0, q1 = wq[lane, mt, 0][w], wq[lane, mt, 1][w]
                                f0, f1 = fac[lane, mt, 0], fac[lane, mt, 1]
                                for h in range(2):
                                    a[lane, h, mt] = [
                                        dequant_pair(q0, 2 * h, f0, not fast, exact_log),
                                        dequant_pair(q1, 2 * h, f1, not fast, exact_log),
                                        dequant_pair(q0, 2 * h + 1, f0, not fast, exact_log),
                                        dequant_pair(q1, 2 * h + 1, f1, not fast, exact_log),
                                    ]
                        if wgmma:
                            wgmma_warp(acc_flat, warp, a, w, xbuf, written, xbuf_addr, nsl, XREG)
                            continue
                        for ns in range(NSM):
                            if ns >= nsl:
                                continue
                            b = {}
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                u = 4 * t + w
                                boff = g * 256 + ((u ^ ((t >> 1) << 1) ^ (g & 1)) * 16)
                                off = ns * 2048 + boff
                                bank_log.append(
                                    ("xr", tile, by, c, warp, w, ns, lane, (off // 16) % 8)
                                )
                                regs = xbuf[off : off + 16].view(np.uint32)
                                b[lane] = [int(v) for v in regs]
                            for mt in range(MT):
                                for h in range(2):
                                    d = [acc[warp * 32 + lane, mt, ns] for lane in range(32)]
                                    mma(
                                        d,
                                        [a[lane, h, mt] for lane in range(32)],
                                        [b[lane][2 * h : 2 * h + 2] for lane in range(32)],
                                    )
            # ---- epilogue
            mult = 2.0**D
            for warp in range(WARPS):
                mtile0 = by * WARPS * MT + warp * MT
                if not any(weight_row(p, mtile0 + mt, 0, 0) >= 0 for mt in range(MT)):
                    continue
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    tid = warp * 32 + lane
                    for mt in range(MT):
                        mtile = mtile0 + mt
                        if p["act"]:
                            j = mtile * 8 + g
                            if j >= p["n_out"]:
                                continue
                            grow, urow = p["g0"] + j * p["step"], p["u0"] + j * p["step"]
                            bg = float(bias[slot, grow]) if bias is not None else 0.0
                            bu = float(bias[slot, urow]) if bias is not None else 0.0
                            for ns in range(nsl):
                                for e in range(2):
                                    lt = ns * 8 + 2 * t + e
                                    if lt >= nrows:
                                        continue
                                    gate = acc[tid, mt, ns, e] * mult + bg
                                    up = acc[tid, mt, ns, 2 + e] * mult + bu
                                    if p["act"] == 2:  # silu(gate) * up
                                        with np.errstate(over="ignore", invalid="ignore"):
                                            y = gate / (1.0 + np.exp(-gate)) * up
                                    else:
                                        gate = p["limit"] if gate > p["limit"] else gate
                                        up = (
                                            p["limit"]
                                            if up > p["limit"]
                                            else (-p["limit"] if up < -p["limit"] else up)
                                        )
                                        with np.errstate(over="ignore", invalid="ignore"):
                                            y = (up + 1.0) * (
                                                gate / (1.0 + np.exp(-gate * p["alpha"]))
                                            )
                                    assert np.isnan(out[start + lt, out_column(j)])
                                    out[start + lt, out_column(j)] = y
                        else:
                            for r in range(2):
                                n = mtile * 16 + g + 8 * r
                                if n >= N:
                                    continue
                                bn = float(bias[slot, n]) if bias is not None else 0.0
                                for ns in range(nsl):
                                    for e in range(2):
                                        lt = ns * 8 + 2 * t + e
                                        if lt >= nrows:
                                            continue
                                        oc = out_column(n)
                                        assert np.isnan(out[start + lt, oc])
                                        out[start + lt, oc] = (
                                            acc[tid, mt, ns, 2 * r + e] * mult + bn
                                        )
    if out_perm:  # read back in natural column order, for the comparison
        out = out[:, [out_column(j) for j in range(p["n_out"])]]
    return out


# ------------------------------------------------------------ reference
def dequant_ref(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    lo = np.array(FP4 + [-v for v in FP4])[blocks & 0xF]
    hi = np.array(FP4 + [-v for v in FP4])[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    s = scales.astype(np.float64)
    with np.errstate(over="ignore"):
        factor = np.where(scales == 255, np.inf, 2.0 ** (s - 127))
    with np.errstate(invalid="ignore", over="ignore"):
        # the torch reference dequantizes in fp32: 6 * 2^127 overflows to inf there
        w = (vals * factor[..., None]).astype(np.float32).astype(np.float64)
    return w.reshape(*scales.shape[:-1], -1)


def reference(p: dict) -> np.ndarray:
    W = dequant_ref(p["blocks"], p["scales"])  # [S, N, K]
    xf = np.array([[bf16_value(int(v)) for v in row] for row in p["x"].view(np.uint16)])
    out = np.full((len(p["x_rows"]), p["n_out"]), np.nan)
    live = set()
    for tile in range(len(p["tile_slot"])):
        slot = int(p["tile_slot"][tile])
        if slot < 0:
            continue
        start, end = int(p["tile_start"][tile]), int(p["tile_end"][tile])
        for r in range(start, min(start + p["block_m"], end)):
            live.add((r, slot))
    for r, slot in sorted(live):
        with np.errstate(invalid="ignore", over="ignore"):
            h = W[slot] @ xf[p["x_rows"][r]]
        if p["bias"] is not None:
            h = h + p["bias"][slot].astype(np.float64)
        if p["act"]:
            cols = np.arange(p["n_out"])
            gate = h[p["g0"] + cols * p["step"]]
            up = h[p["u0"] + cols * p["step"]]
            if p["act"] == 2:
                with np.errstate(over="ignore", invalid="ignore"):
                    out[r] = gate / (1.0 + np.exp(-gate)) * up
                continue
            gate = np.where(gate > p["limit"], p["limit"], gate)
            up = np.where(up > p["limit"], p["limit"], np.where(up < -p["limit"], -p["limit"], up))
            with np.errstate(over="ignore", invalid="ignore"):
                out[r] = (up + 1.0) * (gate / (1.0 + np.exp(-gate * p["alpha"])))
        else:
            out[r] = h
    return out


def tile_map(key: np.ndarray, width: int, block_m: int) -> tuple:
    """pdflash.models.compressed_gemm.tile_map's rule (numpy)."""
    n = len(key)
    bound = -(-n // block_m) + min(width, n, width)
    starts = np.searchsorted(key, np.arange(width), side="left")
    ends = np.searchsorted(key, np.arange(width), side="right")
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = np.cumsum(tiles)
    t = np.arange(bound)
    g = np.searchsorted(tile_ends, t, side="right")
    gc = np.minimum(g, width - 1)
    start = starts[gc] + (t - (tile_ends[gc] - tiles[gc])) * block_m
    slot = np.where(g < width, gc, -1)
    return slot.astype(np.int32), start.astype(np.int32), ends[gc].astype(np.int32)


def make_problem(rng, *, S, N, K, tokens, top_k, block_m, act, scale_range, extreme=False,
                 out_perm=False):  # fmt: skip
    blocks = rng.integers(0, 256, (S, N, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(scale_range[0], scale_range[1] + 1, (S, N, K // 32), dtype=np.uint8)
    if extreme:  # a few rows with one extreme scale byte each
        for v in (0, 1, 2, 3, 250, 252, 253, 254, 255):
            scales[rng.integers(S), rng.integers(N), rng.integers(K // 32)] = v
    x = (rng.standard_normal((tokens, K)).astype(np.float32)).view(np.uint32)
    x_bf16 = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)
    experts = np.argsort(rng.random((tokens, S)), axis=1)[:, :top_k].reshape(-1)
    order = np.argsort(experts, kind="stable")
    key = experts[order]
    x_rows = (order // top_k).astype(np.int32)
    slot, start, end = tile_map(key, S, block_m)
    # a dead tile in the middle (garbage range) must be skipped
    slot = np.insert(slot, len(slot) // 2, -1)
    start = np.insert(start, len(start) // 2, 12345)
    end = np.insert(end, len(end) // 2, -7)
    bias = rng.standard_normal((S, N)).astype(np.float32) * 0.1
    if act == 3:  # silu(gate) * up over stacked gate / up rows (the SwiGLU archs)
        n_out, g0, u0, step, act = N // 2, 0, N // 2, 1, 2
    elif act == 2:  # gate rows then up rows (SwiGLU archs' stacking): the fallback staging
        n_out, g0, u0, step, act = N // 2, 0, N // 2, 1, 1
    elif act:
        n_out, g0, u0, step = N // 2, 0, 1, 2
    else:
        n_out, g0, u0, step = N, 0, 0, 1
    return dict(
        blocks=blocks, scales=scales, x=x_bf16.view(np.uint16), x_rows=x_rows, bias=bias,
        tile_slot=slot, tile_start=start, tile_end=end, block_m=block_m, N=N, K=K,
        n_out=n_out, act=act, g0=g0, u0=u0, step=step, alpha=1.702, limit=7.0,
        out_perm=out_perm,
    )  # fmt: skip


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    live = ~np.isnan(want) | ~np.isnan(got)
    same_nonfinite = np.array_equal(np.isnan(got[live]), np.isnan(want[live])) and np.array_equal(
        np.isinf(got[live]) * np.sign(np.nan_to_num(got[live])),
        np.isinf(want[live]) * np.sign(np.nan_to_num(want[live])),
    )
    fin = live & np.isfinite(want) & np.isfinite(got)
    scale = max(1.0, float(np.abs(want[fin]).max())) if fin.any() else 1.0
    err = float(np.abs(got[fin] - want[fin]).max() / scale) if fin.any() else 0.0
    return err, same_nonfinite


def scale_conflicts(log: list) -> int:
    """Scale byte loads (one per lane) whose 32-bit words collide in a bank
    with a different word (same word = broadcast); informational: at small K
    the rows pack densely; :func:`scale_banks_gptoss` checks the real shape."""
    groups: dict = {}
    for rec in log:
        if rec[0] == "sc":
            *key, _lane, word = rec
            groups.setdefault(tuple(key), set()).add(word)
    n = 0
    for words in groups.values():
        banks = [w % 32 for w in words]
        n += len(banks) - len(set(banks))
    return n


def scale_banks_gptoss(KB: int = 90) -> list[str]:
    """The 8 distinct rows g of a warp's scale byte load at K = 32 KB, both
    contiguous layouts (act 0: row g; gpt-oss act 1: row 2g), any chunk / t:
    distinct banks (or the same word)."""
    bad = []
    for act in (0, 1):
        for r in (0, 1):
            for c in range((KB + 3) // 4):
                for t in range(4):
                    words = {}
                    for g in range(8):
                        row = (2 * g + r) if act else (g + 8 * r)
                        w = (row * KB + 4 * c + t) // 4
                        words.setdefault(w % 32, set()).add(w)
                    if any(len(v) > 1 for v in words.values()):
                        bad.append(f"act={act} r={r} c={c} t={t}")
    return bad


def check_banks(log: list) -> list[str]:
    """Each quarter warp (8 lanes) of a 128-bit access must hit 8 distinct
    16-byte bank groups (B reads, x writes)."""
    bad = []
    groups: dict = {}
    for rec in log:
        if rec[0] == "xr":
            *key, lane, bank = rec
            groups.setdefault(("xr", *key, lane // 8), []).append(bank)
    for key, banks in groups.items():
        if key[0] == "xr" and len(set(banks)) != len(banks):
            bad.append(f"B read conflict {key}: {banks}")
    # x writes: consecutive tids of a warp, per unit index i: 8-lane phases
    wr: dict = {}
    for rec in log:
        if rec[0] == "xw":
            _, tile, by, c, i, tid, bank = rec
            wr.setdefault((tile, by, c, i, tid // 8), []).append(bank)
    for key, banks in wr.items():
        if len(set(banks)) != len(banks):
            bad.append(f"x write conflict {key}: {banks}")
    return bad


#: (name, make_problem kwargs, kernel cfg (WARPS, MT, NSM[, KIND])); make_problem's
#: act: 0 none, 1 gpt-oss interleaved, 2 gpt-oss stacked, 3 silu stacked. The
#: wgmma cases (names "wg ...") use the library's wgmma variant's shape (8 warps
#: = 2 warpgroups, MT 1) at its three NSM builds.
CASES = [
        # (name, problem kwargs, kernel cfg (WARPS, MT, NSM))
        ("act=0 K=320 bm16 realistic", dict(S=4, N=40, K=320, tokens=5, top_k=2, block_m=16, act=0, scale_range=(118, 130)), (2, 1, 2)),
        ("act=1 K=320 bm16 realistic", dict(S=4, N=40, K=320, tokens=5, top_k=2, block_m=16, act=1, scale_range=(118, 130)), (2, 2, 2)),
        ("act=1 K=192 bm32 13+ rows", dict(S=2, N=36, K=192, tokens=14, top_k=2, block_m=32, act=1, scale_range=(118, 130)), (1, 2, 4)),
        ("act=0 K=128 bm64 >32 rows", dict(S=2, N=24, K=128, tokens=40, top_k=2, block_m=64, act=0, scale_range=(100, 128)), (2, 1, 8)),
        ("act=0 K=96 D=0 wide fast", dict(S=2, N=20, K=96, tokens=6, top_k=1, block_m=16, act=0, scale_range=(2, 128)), (1, 1, 2)),
        ("act=1 scales 180..240 fast D>0", dict(S=2, N=40, K=256, tokens=6, top_k=1, block_m=16, act=1, scale_range=(180, 240)), (2, 1, 2)),
        ("act=0 scales 60..200 (slow)", dict(S=2, N=40, K=256, tokens=6, top_k=1, block_m=16, act=0, scale_range=(60, 200)), (2, 1, 2)),
        ("act=1 stacked (fallback stage)", dict(S=3, N=48, K=256, tokens=9, top_k=2, block_m=16, act=2, scale_range=(118, 130)), (2, 1, 2)),
        ("act=1 K=224 extreme (slow)", dict(S=3, N=34, K=224, tokens=7, top_k=2, block_m=16, act=1, scale_range=(120, 126), extreme=True), (2, 1, 2)),
    ("act=0 K=224 extreme (slow)", dict(S=3, N=34, K=224, tokens=7, top_k=2, block_m=16, act=0, scale_range=(120, 126), extreme=True), (2, 1, 2)),
    ("silu stacked K=192 bm32", dict(S=3, N=40, K=192, tokens=9, top_k=2, block_m=32, act=3, scale_range=(118, 130)), (2, 1, 4)),
    ("wg act=0 K=320 bm16", dict(S=3, N=72, K=320, tokens=5, top_k=2, block_m=16, act=0, scale_range=(118, 130)), (8, 1, 2, 1)),
    ("wg act=1 K=192 bm32 13+ rows", dict(S=2, N=72, K=192, tokens=14, top_k=2, block_m=32, act=1, scale_range=(118, 130)), (8, 1, 4, 1)),
    ("wg act=0 K=160 bm64 >32 rows", dict(S=2, N=40, K=160, tokens=40, top_k=2, block_m=64, act=0, scale_range=(100, 128)), (8, 1, 8, 1)),
    ("wg act=1 K=224 bm64 extreme (slow)", dict(S=2, N=80, K=224, tokens=30, top_k=2, block_m=64, act=1, scale_range=(120, 126), extreme=True), (8, 1, 8, 1)),
    ("wg act=0 bm64 scales 180..240 fast D>0", dict(S=2, N=24, K=96, tokens=21, top_k=2, block_m=64, act=0, scale_range=(180, 240)), (8, 1, 8, 1)),
    ("wg act=1 stacked bm16 (fallback stage)", dict(S=3, N=48, K=256, tokens=9, top_k=2, block_m=16, act=2, scale_range=(118, 130)), (8, 1, 2, 1)),
    ("wg silu stacked K=128 bm64", dict(S=2, N=40, K=128, tokens=18, top_k=2, block_m=64, act=3, scale_range=(118, 130)), (8, 1, 8, 1)),
    ("wg 3 warpgroups act=1 K=160 bm64", dict(S=2, N=400, K=160, tokens=40, top_k=2, block_m=64, act=1, scale_range=(118, 130)), (12, 1, 8, 1)),
    ("wg 4 warpgroups act=0 K=96 bm64", dict(S=2, N=280, K=96, tokens=36, top_k=2, block_m=64, act=0, scale_range=(100, 128)), (16, 1, 8, 1)),
    ("wgpx act=0 K=160 bm64 >32 rows", dict(S=2, N=40, K=160, tokens=40, top_k=2, block_m=64, act=0, scale_range=(100, 128)), (8, 1, 8, 2)),
    ("wgpx act=1 K=224 bm64 extreme (slow)", dict(S=2, N=80, K=224, tokens=30, top_k=2, block_m=64, act=1, scale_range=(120, 126), extreme=True), (8, 1, 8, 2)),
    ("wgpx act=1 K=96 bm16", dict(S=3, N=72, K=96, tokens=5, top_k=2, block_m=16, act=1, scale_range=(118, 130)), (8, 1, 2, 2)),
    ("wgpx act=0 K=384 bm32", dict(S=2, N=40, K=384, tokens=14, top_k=2, block_m=32, act=0, scale_range=(118, 130)), (8, 1, 4, 2)),
    ("wgpx act=1 K=160 bm64 out chunk-permuted", dict(S=2, N=320, K=160, tokens=40, top_k=2, block_m=64, act=1, scale_range=(118, 130), out_perm=True), (8, 1, 8, 2)),
    ("mma act=0 K=96 bm16 out chunk-permuted", dict(S=2, N=160, K=96, tokens=9, top_k=2, block_m=16, act=0, scale_range=(118, 130), out_perm=True), (4, 1, 2)),
]  # fmt: skip


def run_case(rng, kw: dict, cfg: tuple[int, ...]) -> dict:
    """One case through the model and the reference: the error, whether the
    non-finite entries match, rows left unset, inexact fast-path products,
    shared-memory bank conflicts, and the CTAs' scale paths."""
    prob = make_problem(rng, **kw)
    bank_log: list = []
    exact_log: list = []
    path_log: list = []
    got = run_model(prob, cfg, bank_log, exact_log, path_log)
    want = reference(prob)
    err, same_nf = compare(got, want)
    return {
        "err": err,
        "nonfinite_match": same_nf,
        "unset": int((np.isnan(got) & ~np.isnan(want)).sum()),
        "inexact_fast": len(exact_log),
        "bank_conflicts": check_banks(bank_log),
        "scale_collisions": scale_conflicts(bank_log),
        "paths": path_log,
        "rows": len(prob["x_rows"]),
        "ref_nonfinite": int((~np.isfinite(want) & ~np.isnan(want)).sum() + np.isnan(want).sum()),
    }


def case_ok(r: dict) -> bool:
    return (
        r["err"] < 1e-9
        and r["nonfinite_match"]
        and r["unset"] == 0
        and not r["inexact_fast"]
        and not r["bank_conflicts"]
    )


def main() -> int:
    rng = np.random.default_rng(0)
    ok_all = True
    for name, kw, cfg in CASES:
        r = run_case(rng, kw, cfg)
        ok = case_ok(r)
        ok_all &= ok
        path_log = r["paths"]
        n_fast = sum(1 for kind, _ in path_log if kind == "fast")
        paths = (
            f"CTAs fast/slow={n_fast}/{len(path_log) - n_fast} maxD={max(d for _, d in path_log)}"
        )
        print(
            f"{'PASS' if ok else 'FAIL'} {name:30s} cfg={cfg} rel_err={r['err']:.2e} "
            f"nonfinite_match={r['nonfinite_match']} unset={r['unset']} inexact_fast={r['inexact_fast']} "
            f"bank_conflicts={len(r['bank_conflicts'])} scale_bank_collisions(info)={r['scale_collisions']} {paths} (rows={r['rows']}, ref nonfinite/NaN-or-unset={r['ref_nonfinite']})"
        )
        for b in r["bank_conflicts"][:3]:
            print("   ", b)
    pb = check_pair_bits(rng)
    print(
        f"{'PASS' if pb else 'FAIL'} e2m1_pair_bits: the kernel's formula = the shift/mask one = value * 2^-126 "
        "(20k random words x 4 pairs, both halves)"
    )
    ok_all &= pb
    sb = scale_banks_gptoss(90)
    print(
        f"{'PASS' if not sb else 'FAIL'} scale byte loads at K=2880 (KB=90), act 0/1 layouts: "
        f"{len(sb)} bank collisions"
    )
    ok_all &= not sb
    print("ALL PASS" if ok_all else "SOME FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
