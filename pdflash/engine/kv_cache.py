"""A paged KV cache: fixed-size pages, per-sequence block tables, byte occupancy.

Every layer has one K and one V tensor of shape
``[num_pages * page_size + 1, kv_heads, head_dim]`` (the last row, the
:attr:`~PagedKVCache.null_slot`, is never written and stays zero; built with
``scratch=True`` one more row, the :attr:`~PagedKVCache.scratch_slot`, takes
the writes of padded rows that no key ever reads); a sequence owns a list of
pages (its block table) and a length. A token at position ``p`` of a sequence
lives in flat slot ``table[p // page_size] * page_size + p % page_size`` of
every layer. Rolling back to a shorter length frees the pages past it;
freeing a sequence returns all its pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class KVCacheFull(RuntimeError):
    """Not enough free pages for an allocation."""


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers sharing one block table."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
            ("num_pages", num_pages),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.dtype = dtype
        #: a slot past every page that stays zero: attention's padded keys
        #: and gpt-oss's sink key read it (no per-layer zeroing)
        self.null_slot = num_pages * page_size
        #: a slot past the null slot (None unless built with ``scratch``):
        #: padded rows of a bucketed forward (:mod:`pdflash.engine.graphs`)
        #: write their K/V here; no key reads it
        self.scratch_slot: int | None = self.null_slot + 1 if scratch else None
        rows = num_pages * page_size + (2 if scratch else 1)
        shape = (rows, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        # NOTE: a stack, so a freed page is reused first (warm in cache) and
        # allocation order is deterministic.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    # -- accounting ---------------------------------------------------------
    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def occupancy_bytes(self) -> int:
        return self.used_pages * self.page_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_nbytes

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    # -- allocation ---------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already in the KV cache")
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for ``length`` tokens (pages only; the length is unchanged).
        Raises :class:`KVCacheFull` with nothing allocated if pages run out."""
        table = self._tables[seq_id]
        need = self.pages_for(length) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            raise KVCacheFull(
                f"sequence {seq_id} needs {need} more KV pages, {len(self._free)} free"
            )
        for _ in range(need):
            table.append(self._free.pop())

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Append ``num_tokens`` positions (host bookkeeping only; their slots
        are :meth:`slot_list`). Raises :class:`KVCacheFull` with nothing
        allocated if pages run out."""
        start = self._lengths[seq_id]
        self.reserve(seq_id, start + num_tokens)
        self._lengths[seq_id] = start + num_tokens

    def extend(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """:meth:`grow`, returning the new positions' flat slots (int64, on
        device: a host->device copy; forwards use :meth:`grow`)."""
        start = self._lengths[seq_id]
        self.grow(seq_id, num_tokens)
        return self.slots(seq_id, start, start + num_tokens)

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back to ``length`` tokens, freeing pages past it."""
        cur = self._lengths[seq_id]
        if not 0 <= length <= cur:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {cur} to {length}")
        table = self._tables[seq_id]
        keep = self.pages_for(length)
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[seq_id] = length

    def free(self, seq_id: int) -> None:
        """Release every page of a sequence; unknown ids are a no-op."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))

    # -- addressing ---------------------------------------------------------
    def slot_list(self, seq_id: int, start: int, end: int) -> list[int]:
        table = self._tables[seq_id]
        ps = self.page_size
        return [table[p // ps] * ps + p % ps for p in range(start, end)]

    def slot_matrix(self, seq_ids: Sequence[int], width: int, fill: int) -> np.ndarray:
        """``[len(seq_ids), width]`` int64: row ``i`` holds the flat slots of
        positions ``0 ..`` of sequence ``seq_ids[i]`` up to its length, then
        ``fill`` (:meth:`slot_list` for many sequences at once, vectorised)."""
        ps = self.page_size
        pages = -(-width // ps)
        tables = np.zeros((len(seq_ids), pages), dtype=np.int64)
        lengths = np.empty(len(seq_ids), dtype=np.int64)
        for i, seq_id in enumerate(seq_ids):
            table = self._tables[seq_id][:pages]
            tables[i, : len(table)] = table
            lengths[i] = self._lengths[seq_id]
        out = (tables[:, :, None] * ps + np.arange(ps)).reshape(len(seq_ids), pages * ps)[:, :width]
        out[np.arange(width)[None, :] >= lengths[:, None]] = fill
        return out

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        return torch.tensor(
            self.slot_list(seq_id, start, end), dtype=torch.int64, device=self.device
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))
