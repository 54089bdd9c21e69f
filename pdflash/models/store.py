"""Expert weights from a Hugging Face safetensors checkpoint, packed for H2D.

:class:`ExpertStore` opens the checkpoint lazily (``safe_open`` memory-maps
each shard; only the tensors asked for are read), finds every expert's
tensors in the architecture's naming, and packs each expert contiguously in
one host buffer: expert ``g = layer * num_experts + expert`` occupies bytes
``[g * expert_nbytes, (g + 1) * expert_nbytes)``. One copy of that range moves
one expert into one cache slot; :meth:`ExpertStore.views` unpacks a slot (host
or device) into the architecture's tensors without copies.

NOTE: packing is eager (all experts at construction, a thread per layer
group): the copy issuer reads host memory from its own thread at any time,
so every source address must be valid and final before the first copy.
The checkpoint itself is read lazily (mmap, per-expert slices).

On a CUDA machine the buffer is page-locked with ``cudaHostRegister`` (a
plain allocation registered in place: no power-of-two rounding as with
``torch.empty(pin_memory=True)``'s caching allocator, and 62 ms/GiB instead
of ``cudaHostAlloc``'s 800 ms/GiB on the H200), or through ``allocator`` when
the caller passes one (e.g. the issuer's pinned allocator).

A store may pack only a subset of the grid (``owned``: an expert-parallel
rank's share, :mod:`pdflash.distributed`): the owned experts are packed
contiguously in flat-id order, ``host_ptrs`` / ``packed`` / ``views`` map a
flat id to its row, and asking for an expert outside the subset raises
:class:`ForeignExpertError` (a rank never reads another rank's bytes).
Flat ids stay global, so the cache, scheduler and books are unchanged.

gpt-oss MXFP4 experts (``*_blocks`` / ``*_scales``) are packed as stored when
the layout says so (the adapters' default: ``expert_nbytes`` is then the
MXFP4 size, and copies, cache slots and byte books count those bytes), or
dequantized to the packed dtype at pack time by a format with
``transform="mxfp4"``, with the same arithmetic as transformers'
``convert_moe_packed_tensors``. Synthetic checkpoints are written in bf16
unless asked for MXFP4.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pdflash.models.layout import (
    ExpertFormat,
    ExpertLayout,
    SourcePart,
    dequantize_mxfp4,
    quantize_fp8,
)
from pdflash.protocols import checked_flat_ids

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint is missing a file or tensor, or a tensor has the wrong shape."""


class ForeignExpertError(ValueError):
    """An expert a partial store (``ExpertStore(owned=...)``) did not pack was
    asked for: under expert parallelism, an expert another rank owns."""


def open_shard(safe_open: Callable[..., Any], file: Path) -> Any:
    """``safe_open(file)``, its errors (a truncated or corrupt file) naming the shard."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})"
        ) from exc


#: dtypes whose finiteness :func:`require_finite` reads from the extrema
#: (``torch.aminmax`` has no float8 kernels)
_MINMAX_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def require_finite(t: torch.Tensor, file: Path, key: str) -> None:
    """Refuse a floating-point tensor holding NaN or Inf, naming file and tensor."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    if t.dtype in _MINMAX_DTYPES:
        # one pass without temporaries: the extrema are finite exactly when
        # every value is (both propagate NaN; an Inf is an extremum); the
        # count, which takes a mask, only for the error's text
        lo, hi = torch.aminmax(t)
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise CheckpointError(
            f"{file}: tensor {key!r} has {bad} non-finite (NaN/Inf) values of {t.numel()} "
            "(pass check_finite=False to load it anyway)"
        )


class SafetensorsCheckpoint:
    """Tensor name -> shard file of a safetensors checkpoint; lazy reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._safe_open = safe_open
        index = self.path / INDEX_FILE
        single = self.path / SINGLE_FILE
        self.weight_map: dict[str, str] = {}
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors shard index ({exc})") from exc
            self.weight_map = {str(k): str(v) for k, v in weight_map.items()}
            missing = sorted({f for f in self.weight_map.values() if not (self.path / f).is_file()})
            if missing:
                example = next(k for k, f in self.weight_map.items() if f == missing[0])
                raise CheckpointError(
                    f"{self.path}: shard file {missing[0]!r} listed in {INDEX_FILE} is missing "
                    f"(it holds e.g. tensor {example!r}); missing shards: {missing}"
                )
        elif single.is_file():
            with open_shard(safe_open, single) as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise CheckpointError(
                f"{self.path}: no {INDEX_FILE} or {SINGLE_FILE} (not a safetensors checkpoint)"
            )
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, key: str) -> Path:
        try:
            return self.path / self.weight_map[key]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: tensor {key!r} not found in the checkpoint"
            ) from None

    def _open(self, key: str) -> Any:
        return open_shard(self._safe_open, self.file_of(key))

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._meta:
            # NOTE: one header read per shard, not per tensor: a full-size
            # checkpoint has ~10^4-10^5 expert tensors.
            file = self.file_of(key)
            with open_shard(self._safe_open, file) as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sl = f.get_slice(k)
                    self._meta[k] = (sl.get_dtype(), tuple(int(d) for d in sl.get_shape()))
            if key not in self._meta:
                raise CheckpointError(
                    f"{file}: tensor {key!r} is listed in the index but not in the file"
                )
        return self._meta[key][1]

    def dtype(self, key: str) -> torch.dtype:
        self.shape(key)
        return _ST_DTYPES[self._meta[key][0]]

    def read(self, key: str, index: int | None = None, handle: Any = None) -> torch.Tensor:
        """The tensor, or its ``[index]`` slice along dim 0 (reads only that slice)."""
        if handle is None:
            with self._open(key) as f:
                return self.read(key, index, handle=f)
        if index is None:
            result: torch.Tensor = handle.get_tensor(key)
            return result
        sliced: torch.Tensor = handle.get_slice(key)[index]
        return sliced


def open_checkpoint(path: str | os.PathLike[str]) -> SafetensorsCheckpoint:
    """The checkpoint at ``path``: its safetensors files, or for a synthetic
    checkpoint written with generated weights, a
    :class:`~pdflash.models.synthetic.GeneratedCheckpoint` drawing them."""
    from pdflash.models.synthetic import GeneratedCheckpoint, is_generated

    if is_generated(path):
        return GeneratedCheckpoint(path)
    return SafetensorsCheckpoint(path)


def _cudart_register(buf: torch.Tensor) -> Callable[[], None]:
    """Page-lock ``buf`` in place; returns the undo."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr = buf.data_ptr()
    err = cudart.cudaHostRegister(ptr, buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed (error {int(err)})")

    def unregister(cudart: Any = cudart, ptr: int = ptr) -> None:
        cudart.cudaHostUnregister(ptr)

    return unregister


def _issuer_unregister(
    issuer: Any, ptr: int, method: str = "unregister_host"
) -> Callable[[], None]:
    ref = weakref.ref(issuer)

    def unregister() -> None:
        live = ref()
        if live is None or getattr(live, "closed", False):
            return  # a closed issuer has unregistered everything already
        with contextlib.suppress(ValueError):  # already unregistered (issuer reset)
            getattr(live, method)(ptr)

    return unregister


def detect_format(
    checkpoint: SafetensorsCheckpoint, formats: Sequence[ExpertFormat]
) -> ExpertFormat:
    """The first of ``formats`` whose layer-0 expert-0 tensors the checkpoint holds."""
    tried = []
    for fmt in formats:
        first = fmt.parts(0, 0)
        tried.append(f"{fmt.name} (e.g. {first[0].key!r})")
        if all(p.key in checkpoint for p in first):
            return fmt
    raise CheckpointError(
        f"{checkpoint.path}: no expert tensors for layer 0 expert 0 in any known "
        f"naming; tried: {'; '.join(tried)}"
    )


class ExpertStore:
    """All experts of a checkpoint, packed in one host buffer.

    Args:
        checkpoint: the checkpoint directory (or an opened
            :class:`SafetensorsCheckpoint`).
        layout: the packed layout of one expert (from the adapter).
        formats: the architecture's checkpoint namings, tried in order.
        num_layers, num_experts: the expert grid.
        pin: page-lock the buffer (default: when CUDA is available).
        allocator: ``nbytes -> uint8 tensor`` for the host buffer; overrides
            ``pin``.
        issuer: when given (and ``allocator`` is not), the buffer is a plain
            allocation registered with ``issuer.register_host`` (page-locked
            on the CUDA backend, and known to the issuer as a valid copy
            source); unregistered by :meth:`close` or garbage collection.
            A buffer from ``allocator`` is made known to an issuer by
            :meth:`register_with` (``issuer.register_source``).
        workers: packing threads (default: CPU count, at most 16).
        check_finite: refuse expert weights holding NaN/Inf (naming the file
            and tensor); ``False`` skips the check (faster loading).
        owned: bool ``[num_layers, num_experts]``: pack only these experts
            (an expert-parallel rank's share; the buffer then holds
            ``owned.sum()`` experts). None (default): every expert. The whole
            checkpoint's expert shapes are validated either way.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | SafetensorsCheckpoint,
        layout: ExpertLayout,
        formats: Sequence[ExpertFormat],
        num_layers: int,
        num_experts: int,
        *,
        pin: bool | None = None,
        allocator: Callable[[int], torch.Tensor] | None = None,
        issuer: Any = None,
        workers: int | None = None,
        check_finite: bool = True,
        owned: npt.ArrayLike | None = None,
    ) -> None:
        self.check_finite = check_finite
        self.checkpoint = (
            checkpoint
            if isinstance(checkpoint, SafetensorsCheckpoint)
            else open_checkpoint(checkpoint)
        )
        self.layout = layout
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.expert_nbytes = layout.nbytes
        #: flat id -> row of the buffer (-1: not packed); None: the identity
        self._row: npt.NDArray[np.int64] | None = None
        self.owned: npt.NDArray[np.bool_] | None = None
        if owned is not None:
            self.owned = self._check_owned(owned)
            self._row = np.full(self.num_ids, -1, dtype=np.int64)
            packed = np.flatnonzero(self.owned.reshape(-1))
            self._row[packed] = np.arange(packed.size, dtype=np.int64)
        self.format = self._detect_format(formats)
        self._validate_all()

        total = self.packed_nbytes
        if pin is None:
            pin = torch.cuda.is_available()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.registered_with: Any = None  # the issuer the buffer is registered with
        self.pinned = False
        if allocator is not None:
            buf = allocator(total)
            if buf.dtype != torch.uint8 or buf.numel() < total or buf.device.type != "cpu":
                raise ValueError(f"allocator must return a CPU uint8 tensor of >= {total} bytes")
            self.buffer = buf.reshape(-1)
            self.pinned = True
            self._external = True
        else:
            self._external = False
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8)
            if issuer is not None:
                self.register_with(issuer)
            elif pin:
                self._set_finalizer(_cudart_register(self.buffer))
                self.pinned = True
        self._pack_all(workers)

    def _check_owned(self, owned: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        mask = np.asarray(owned)
        if mask.dtype != np.bool_ or mask.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"owned must be a bool ({self.num_layers}, {self.num_experts}) mask, "
                f"got {mask.dtype} {mask.shape}"
            )
        result: npt.NDArray[np.bool_] = mask.copy()
        return result

    # -- checkpoint discovery ------------------------------------------------

    def _detect_format(self, formats: Sequence[ExpertFormat]) -> ExpertFormat:
        return detect_format(self.checkpoint, formats)

    def expert_parts(self, layer: int, expert: int) -> list[SourcePart]:
        return self.format.parts(layer, expert)

    def expert_keys(self) -> set[str]:
        """Every checkpoint tensor name that holds expert weights."""
        keys: set[str] = set()
        for layer in range(self.num_layers):
            for expert in range(self.num_experts):
                for p in self.format.parts(layer, expert):
                    keys.add(p.key)
                    if p.scales_key is not None:
                        keys.add(p.scales_key)
        return keys

    def _validate_all(self) -> None:
        ck = self.checkpoint
        seen: set[str] = set()
        for layer in range(self.num_layers):
            for expert in range(self.num_experts):
                for p in self.format.parts(layer, expert):
                    for key, want in self._expected_shapes(p):
                        if key in seen:
                            continue
                        seen.add(key)
                        if key not in ck:
                            raise CheckpointError(
                                f"{ck.path}: expert tensor {key!r} (layer {layer}, expert "
                                f"{expert}, {self.format.name} naming) not found in the checkpoint"
                            )
                        got = ck.shape(key)
                        if got != want:
                            raise CheckpointError(
                                f"{ck.file_of(key)}: tensor {key!r} has shape {list(got)}, "
                                f"expected {list(want)} from config.json"
                            )

    def _expected_shapes(self, p: SourcePart) -> list[tuple[str, tuple[int, ...]]]:
        lead = () if p.index is None else (self.num_experts,)
        out = [(p.key, (*lead, *p.shape))]
        if p.transform == "mxfp4":
            assert p.scales_key is not None
            out.append((p.scales_key, (*lead, *p.shape[:-1])))
        return out

    # -- packing ---------------------------------------------------------------

    def _pack_layer(self, layer: int) -> None:
        handles: dict[Path, Any] = {}
        experts: Iterable[int] = range(self.num_experts)
        if self.owned is not None:
            experts = np.flatnonzero(self.owned[layer]).tolist()
        try:
            for expert in experts:
                views = self.views(layer * self.num_experts + expert)
                for p in self.format.parts(layer, expert):
                    dst = views[p.component]
                    src = self._read_part(p, handles)
                    if self.check_finite:
                        require_finite(src, self.checkpoint.file_of(p.key), p.key)
                    if p.transform in ("fp8_rows", "fp8_cols"):
                        self._pack_fp8(p, src, views)
                        continue
                    rows = src.shape[0]
                    if p.row_offset or rows != dst.shape[0]:
                        dst = dst[p.row_offset : p.row_offset + rows]
                    if tuple(src.shape) != tuple(dst.shape):
                        raise CheckpointError(
                            f"{self.checkpoint.file_of(p.key)}: tensor {p.key!r} gives "
                            f"{list(src.shape)} for {p.component!r} rows {p.row_offset}.., "
                            f"expected {list(dst.shape)}"
                        )
                    dst.copy_(src)
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)

    def _pack_fp8(self, p: SourcePart, src: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        axis = 0 if p.transform == "fp8_rows" else 1
        values, scale = quantize_fp8(src, axis)
        dst, dst_scale = views[p.component], views[f"{p.component}_scale"]
        if axis == 0:  # a row part lands at its row offset, with its rows' scales
            rows = slice(p.row_offset, p.row_offset + values.shape[0])
            dst, dst_scale = dst[rows], dst_scale[rows]
        if tuple(values.shape) != tuple(dst.shape) or scale.numel() != dst_scale.numel():
            raise CheckpointError(
                f"{self.checkpoint.file_of(p.key)}: tensor {p.key!r} gives {list(src.shape)} "
                f"for {p.component!r}, expected {list(dst.shape)}"
            )
        dst.copy_(values)
        dst_scale.copy_(scale)

    def _handle(self, key: str, handles: dict[Path, Any]) -> Any:
        file = self.checkpoint.file_of(key)
        if file not in handles:
            h = self.checkpoint._open(key)
            h.__enter__()
            handles[file] = h
        return handles[file]

    def _read_part(self, p: SourcePart, handles: dict[Path, Any]) -> torch.Tensor:
        ck = self.checkpoint
        src = ck.read(p.key, p.index, handle=self._handle(p.key, handles))
        if p.transform in (None, "fp8_rows", "fp8_cols"):
            return src
        if p.transform == "mxfp4":
            assert p.scales_key is not None
            scales = ck.read(p.scales_key, p.index, handle=self._handle(p.scales_key, handles))
            return dequantize_mxfp4(src, scales, self.layout.dtype).t()
        raise ValueError(f"unknown source transform {p.transform!r}")

    def _pack_all(self, workers: int | None) -> None:
        n = workers if workers is not None else min(16, os.cpu_count() or 1)
        if n <= 1 or self.num_layers == 1:
            for layer in range(self.num_layers):
                self._pack_layer(layer)
            return
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(self._pack_layer, range(self.num_layers)))

    # -- access ----------------------------------------------------------------

    @property
    def num_ids(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def total_nbytes(self) -> int:
        """The bytes of every expert of the model (packed here or not)."""
        return self.num_ids * self.expert_nbytes

    @property
    def num_packed(self) -> int:
        """How many experts this store packed (all, or the ``owned`` ones)."""
        return self.num_ids if self.owned is None else int(self.owned.sum())

    @property
    def packed_nbytes(self) -> int:
        """The host bytes this store packed (its buffer, less any padding)."""
        return self.num_packed * self.expert_nbytes

    def packed_ids(self) -> npt.NDArray[np.int64]:
        """The flat ids this store packed, ascending (all, or the ``owned``)."""
        if self.owned is None:
            return np.arange(self.num_ids, dtype=np.int64)
        return np.flatnonzero(self.owned.reshape(-1)).astype(np.int64)

    def _foreign(self, g: int) -> ForeignExpertError:
        layer, expert = divmod(g, self.num_experts)
        return ForeignExpertError(
            f"expert {g} (layer {layer}, expert {expert}) is not packed in this host store: "
            f"it holds only the {self.num_packed} experts of its owned set (another "
            "rank owns this one under expert parallelism)"
        )

    def _rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Buffer rows of checked flat ids (ForeignExpertError if not packed)."""
        if self._row is None:
            return ids
        rows = self._row[ids]
        if ids.size and rows.min() < 0:
            raise self._foreign(int(ids[int(np.argmin(rows))]))
        return rows

    def packed(self, flat_id: int) -> torch.Tensor:
        """The packed bytes of one expert (a view into the host buffer)."""
        g = int(flat_id)
        if not 0 <= g < self.num_ids:
            raise ValueError(f"expert id {g} out of range [0, {self.num_ids})")
        start = int(self._rows(np.array([g], dtype=np.int64))[0]) * self.expert_nbytes
        return self.buffer[start : start + self.expert_nbytes]

    def views(self, flat_id: int) -> dict[str, torch.Tensor]:
        """The expert's tensors as views into the host buffer."""
        return self.layout.views(self.packed(flat_id))

    def host_ptrs(self, flat_ids: Iterable[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """Host source addresses of the given experts (for ``CopyIssuer.submit``)."""
        ids = checked_flat_ids(np.asarray(flat_ids, dtype=np.int64), self.num_ids)
        return self.buffer.data_ptr() + self._rows(ids) * self.expert_nbytes

    def stacked(self, layer: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """All of one layer's experts as ``[E, ...]`` tensors on ``device``
        (for a resident baseline; a partial store must own the whole layer)."""
        first = layer * self.num_experts
        # owned rows are in flat-id order: a wholly owned layer is contiguous
        ids = checked_flat_ids(np.arange(first, first + self.num_experts), self.num_ids)
        start = int(self._rows(ids)[0]) * self.expert_nbytes
        rows = self.buffer[start : start + self.num_experts * self.expert_nbytes]
        dev = rows.to(device).view(self.num_experts, self.expert_nbytes)
        return {n: v.contiguous() for n, v in self.layout.slab_views(dev).items()}

    def _set_finalizer(self, undo: Callable[[], None]) -> None:
        self._finalizer = weakref.finalize(self, undo)

    def register_with(self, issuer: Any) -> None:
        """Make the host buffer a valid copy source for ``issuer``: registered
        with ``issuer.register_host`` (page-locked on its CUDA backend),
        replacing any earlier registration. No-op if already done; issuers
        without ``register_host`` (test doubles) are accepted as they are."""
        if self.registered_with is issuer:
            return
        if self._external and hasattr(issuer, "register_source"):
            # the caller's allocator pinned it; the issuer only reads regions
            # it was given (on CUDA it checks that both ends are pinned)
            self.close()
            ptr = self.buffer.data_ptr()
            issuer.register_source(ptr, self.buffer.numel())
            self._set_finalizer(_issuer_unregister(issuer, ptr, "unregister_source"))
            self.registered_with = issuer
            return
        if self._external or not hasattr(issuer, "register_host"):
            # a test double that copies from any address
            self.registered_with = issuer
            return
        self.close()  # drop an earlier registration (another issuer, or cudart)
        ptr = self.buffer.data_ptr()
        issuer.register_host(ptr, self.buffer.numel())
        self._set_finalizer(_issuer_unregister(issuer, ptr))
        self.registered_with = issuer
        self.pinned = issuer.backend == "cuda"

    def close(self) -> None:
        """Unregister the host buffer (idempotent); the bytes stay valid."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self.pinned = self._external  # the caller's allocator pinned it
        self.registered_with = None
