"""Pure-Python reference of the native host expert MLP
(``pdflash_native._hostmlp``, ``cuda/include/pdflash/host_mlp.h``).

* :func:`pack_w1` / :func:`pack_w2`: the packed weight layout, written
  element by element from the header's index formula (NumPy index arrays;
  :mod:`pdflash.hybrid.native` packs with tensor reshapes and is compared
  to these bit for bit);
* :func:`unpack_w1` / :func:`unpack_w2`: the inverse (the tests check that
  packing round-trips);
* :func:`pack_mxfp4_w1` / :func:`pack_mxfp4_w2`: the MXFP4 variant (codes
  and block scales in the same tiles), and :func:`dequantize_packed_mxfp4`,
  what the kernel makes of them: the bf16 layout's bits, from the header's
  byte formula and the e2m1 table (the tests compare it with the bf16
  packing of the library's own dequantizer);
* :func:`decode_fp8`: packed e4m3 codes (the FP8 variant keeps each code
  in its bf16 element's place) -> the bf16 layout's bits, by torch's own
  e4m3 -> bf16 conversion;
* :func:`mlp`: the expert MLP in float32 from the packed weights, with g
  rounded to bf16 before the second product as the kernel does
  (``round_g=False``: the plain float32 function, what the adapters
  compute in float32).

Slow on purpose; never used at run time.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

TILE_COLS = 32
W1_TILE_INTER = 16
ACT_SWIGLU_SILU = 0
ACT_GPT_OSS_CLAMP = 1


PAIR_ALIGN = 16


def inter_pad(inter: int) -> int:
    return (inter + 2 * PAIR_ALIGN - 1) // (2 * PAIR_ALIGN) * (2 * PAIR_ALIGN)


def hidden_pairs(hidden: int) -> int:
    pairs = (hidden + 1) // 2
    return (pairs + PAIR_ALIGN - 1) // PAIR_ALIGN * PAIR_ALIGN


def _bits(w: torch.Tensor) -> npt.NDArray[np.uint16]:
    """A bf16 matrix's raw bits as uint16."""
    return w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def pack_w1(gate: torch.Tensor, up: torch.Tensor) -> npt.NDArray[np.uint16]:
    """``gate``/``up`` ``[I, H]`` (``[out, in]``) -> the packed W1: element
    ``((t * P + p) * 32 + c) * 2 + j`` is ``gate[16 t + c, 2 p + j]`` for
    ``c < 16`` and ``up[16 t + c - 16, 2 p + j]`` otherwise (0 outside),
    ``P = hidden_pairs(H)``."""
    inter, hidden = gate.shape
    g, u = _bits(gate), _bits(up)
    tiles, pairs = inter_pad(inter) // W1_TILE_INTER, hidden_pairs(hidden)
    t, p, c, j = np.indices((tiles, pairs, TILE_COLS, 2))
    row = W1_TILE_INTER * t + c % W1_TILE_INTER
    col = 2 * p + j
    ok = (row < inter) & (col < hidden)
    src = np.where(c < W1_TILE_INTER, 0, 1)
    out = np.zeros((tiles, pairs, TILE_COLS, 2), dtype=np.uint16)
    rr, cc = np.minimum(row, inter - 1), np.minimum(col, hidden - 1)
    out[ok & (src == 0)] = g[rr, cc][ok & (src == 0)]
    out[ok & (src == 1)] = u[rr, cc][ok & (src == 1)]
    return out.reshape(-1)


def pack_w2(down: torch.Tensor) -> npt.NDArray[np.uint16]:
    """``down`` ``[H, I]`` (``[out, in]``) -> the packed W2: element
    ``((t * P + p) * 32 + c) * 2 + j`` is ``down[32 t + c, 2 p + j]``
    (0 outside), ``P = inter_pad(I) / 2``."""
    hidden, inter = down.shape
    d = _bits(down)
    tiles, pairs = -(-hidden // TILE_COLS), inter_pad(inter) // 2
    t, p, c, j = np.indices((tiles, pairs, TILE_COLS, 2))
    row, col = TILE_COLS * t + c, 2 * p + j
    ok = (row < hidden) & (col < inter)
    out = np.zeros((tiles, pairs, TILE_COLS, 2), dtype=np.uint16)
    out[ok] = d[np.minimum(row, hidden - 1), np.minimum(col, inter - 1)][ok]
    return out.reshape(-1)


#: e2m1 code -> bf16 bits (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the negatives)
_E2M1_POSITIVE = [0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0]
E2M1_BF16 = np.array([*_E2M1_POSITIVE, *(0x8000 | b for b in _E2M1_POSITIVE)], dtype=np.uint16)


def _codes(blocks: torch.Tensor) -> npt.NDArray[np.uint8]:
    """MXFP4 blocks ``[R, G, 16]`` -> codes ``[R, 32 G]``: value ``32 g + 2 m + n``
    is nibble ``n`` (0: low) of byte ``m`` of block ``g``."""
    b: npt.NDArray[np.uint8] = blocks.numpy()
    rows, groups = b.shape[:2]
    r, k = np.indices((rows, 32 * groups))
    codes: npt.NDArray[np.uint8] = ((b[r, k // 32, (k % 32) // 2] >> (4 * (k % 2))) & 0xF).astype(
        np.uint8
    )
    return codes


def _nibble_pairs(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """A packed matrix of codes (64 per pair row) -> its bytes: byte ``b`` of
    a pair row holds element ``b``'s code low, element ``b + 32``'s high."""
    rows = codes.reshape(-1, 64)
    out = np.zeros((rows.shape[0], 32), dtype=np.uint8)
    for b in range(32):
        out[:, b] = rows[:, b] | (rows[:, b + 32] << 4)
    return out.reshape(-1)


def pack_mxfp4_w1(
    gate_blocks: torch.Tensor,
    up_blocks: torch.Tensor,
    gate_scales: torch.Tensor,
    up_scales: torch.Tensor,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """MXFP4 gate/up (``[I, H / 32, 16]``, ``[I, H / 32]``) -> W1's codes
    (the bf16 layout's element ``((t P + p) 32 + c) 2 + j`` in byte
    ``(t P + p) 32 + (e mod 32)`` of its pair row, nibble ``e // 32``, ``e = 2 c + j``)
    and scales (byte ``(t G + g) 32 + c``: column ``c``'s scale of group ``g``)."""
    g, u = _codes(gate_blocks), _codes(up_blocks)
    inter, hidden = g.shape
    tiles, pairs = inter // W1_TILE_INTER, hidden // 2
    t, p, c, j = np.indices((tiles, pairs, TILE_COLS, 2))
    row = W1_TILE_INTER * t + c % W1_TILE_INTER
    codes = np.where(c < W1_TILE_INTER, g[row, 2 * p + j], u[row, 2 * p + j]).astype(np.uint8)
    gs, us = gate_scales.numpy(), up_scales.numpy()
    t, gr, c = np.indices((tiles, hidden // 32, TILE_COLS))
    row = W1_TILE_INTER * t + c % W1_TILE_INTER
    scales = np.where(c < W1_TILE_INTER, gs[row, gr], us[row, gr]).astype(np.uint8)
    return _nibble_pairs(codes.reshape(-1)), scales.reshape(-1)


def pack_mxfp4_w2(
    down_blocks: torch.Tensor, down_scales: torch.Tensor
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """MXFP4 down (``[H, I / 32, 16]``, ``[H, I / 32]``) -> W2's codes and scales."""
    d = _codes(down_blocks)
    hidden, inter = d.shape
    tiles, pairs = hidden // TILE_COLS, inter // 2
    t, p, c, j = np.indices((tiles, pairs, TILE_COLS, 2))
    codes = d[TILE_COLS * t + c, 2 * p + j].astype(np.uint8)
    ds = down_scales.numpy()
    t, gr, c = np.indices((tiles, inter // 32, TILE_COLS))
    return _nibble_pairs(codes.reshape(-1)), ds[TILE_COLS * t + c, gr].astype(np.uint8).reshape(-1)


def dequantize_packed_mxfp4(
    codes: npt.NDArray[np.uint8], scales: npt.NDArray[np.uint8]
) -> npt.NDArray[np.uint16]:
    """Packed MXFP4 codes and scales -> the bf16 layout's bits, as the kernel
    dequantizes them: ``e2m1(code)`` with ``scale - 127`` added to its
    exponent (zeros kept; exact for scales in [2, 252])."""
    rows = codes.reshape(-1, 32)  # pair rows
    out = np.zeros((rows.shape[0], 64), dtype=np.uint16)
    # a tile's pair rows in groups of 16 share each column's scale
    per_group = scales.reshape(-1, TILE_COLS)
    for e in range(64):
        code = (rows[:, e % 32] >> (4 * (e // 32))) & 0xF
        scale = per_group[np.arange(rows.shape[0]) // 16, e // 2].astype(np.int64)
        bits = E2M1_BF16[code].astype(np.int64)
        out[:, e] = np.where(code & 7, (bits + (scale - 127) * 128) & 0xFFFF, bits)
    return out.reshape(-1)


def decode_fp8(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint16]:
    """e4m3fn codes -> their values' bf16 bits (exact: every e4m3 value is a
    bf16 value)."""
    t = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn)
    bits: npt.NDArray[np.uint16] = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bits


def _as_f32(bits: npt.NDArray[np.uint16]) -> torch.Tensor:
    return (
        torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy())
        .view(torch.bfloat16)
        .float()
    )


def unpack_w1(
    packed: npt.NDArray[np.uint16], hidden: int, inter: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed W1 -> float32 ``(gate, up)``, each ``[I, H]``."""
    tiles, pairs = inter_pad(inter) // W1_TILE_INTER, hidden_pairs(hidden)
    w = _as_f32(packed).view(tiles, pairs, TILE_COLS, 2)
    w = w.permute(0, 2, 1, 3).reshape(tiles, TILE_COLS, 2 * pairs)
    gate = w[:, :W1_TILE_INTER].reshape(-1, 2 * pairs)[:inter, :hidden]
    up = w[:, W1_TILE_INTER:].reshape(-1, 2 * pairs)[:inter, :hidden]
    return gate.contiguous(), up.contiguous()


def unpack_w2(packed: npt.NDArray[np.uint16], hidden: int, inter: int) -> torch.Tensor:
    """The packed W2 -> float32 ``down`` ``[H, I]``."""
    tiles, pairs = -(-hidden // TILE_COLS), inter_pad(inter) // 2
    w = _as_f32(packed).view(tiles, pairs, TILE_COLS, 2).permute(0, 2, 1, 3)
    return w.reshape(tiles * TILE_COLS, 2 * pairs)[:hidden, :inter].contiguous()


def mlp(
    x: torch.Tensor,
    w1: npt.NDArray[np.uint16],
    w2: npt.NDArray[np.uint16],
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    *,
    hidden: int,
    inter: int,
    act: int,
    alpha: float = 0.0,
    limit: float = 0.0,
    round_g: bool = True,
    scales1: torch.Tensor | None = None,
    scales2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert MLP over ``x [n, H]`` (rounded to bf16 first, as the kernel
    reads it) from packed weights, in float32. ``b1``: float32
    ``[2 * inter_pad(I)]`` (gate biases, then up biases), ``b2``: ``[H]``;
    ``scales1`` / ``scales2`` (FP8): column scales in ``b1``'s / ``b2``'s
    layout, multiplying each product before its bias."""
    gate_w, up_w = unpack_w1(w1, hidden, inter)
    down = unpack_w2(w2, hidden, inter)
    xf = x.to(torch.bfloat16).float()
    gate, up = xf @ gate_w.t(), xf @ up_w.t()
    if scales1 is not None:
        ip = inter_pad(inter)
        gate = gate * scales1[:inter].float()
        up = up * scales1[ip : ip + inter].float()
    if b1 is not None:
        ip = inter_pad(inter)
        gate = gate + b1[:inter].float()
        up = up + b1[ip : ip + inter].float()
    if act == ACT_GPT_OSS_CLAMP:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        g = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    elif act == ACT_SWIGLU_SILU:
        g = gate * torch.sigmoid(gate) * up
    else:
        raise ValueError(f"unknown activation {act}")
    if round_g:
        g = g.to(torch.bfloat16).float()
    out = g @ down.t()
    if scales2 is not None:
        out = out * scales2[:hidden].float()
    return out if b2 is None else out + b2.float()
