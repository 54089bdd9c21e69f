"""Fixtures for the models/cache tests: a tiny checkpoint per arch, the real
issuer (host backend; CUDA backend for GPU tests), and a fake issuer for
failure injection and for holding copies in flight deterministically; and
helpers test modules import (``from issuer_fixtures import ...``): the
transformers reference model, seeded token ids, adapters with the
smallest legal cache or every expert resident, and an expert source with
recognisable bytes (:class:`PatternExperts`)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.protocols import Band

ARCHS = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe")


def expert_byte(g: int) -> int:
    """The byte every one of expert ``g``'s bytes holds in :class:`PatternExperts`."""
    return g % 251


class PatternExperts:
    """An expert source (``pdflash.cache.ExpertSource``) over one host
    buffer: ``layers x experts`` experts of ``nbytes`` each, expert ``g``'s
    bytes all :func:`expert_byte` ``(g)``, so a slot shows whose copy landed."""

    def __init__(self, layers: int, experts: int, nbytes: int) -> None:
        self.num_layers, self.num_experts, self.expert_nbytes = layers, experts, nbytes
        ids = torch.arange(layers * experts) % 251
        self.buffer = ids.to(torch.uint8).repeat_interleave(nbytes)

    def host_ptrs(self, flat_ids: Any) -> npt.NDArray[np.int64]:
        return self.buffer.data_ptr() + np.asarray(flat_ids, dtype=np.int64) * self.expert_nbytes


class FakeIssuer:
    """A CopyIssuer that records submissions and copies when waited on (or
    immediately with ``eager=True``); ``fail_keys`` makes those copies fail."""

    backend = "host"

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager
        self.queue: dict[
            int, tuple[int, int, int, int, Band]
        ] = {}  # ticket -> (src,dst,n,key,band)
        self.ticket_of_key: dict[int, int] = {}
        self.done: set[int] = set()
        self.submitted: list[tuple[int, Band]] = []  # (key, band)
        self.fail_keys: set[int] = set()
        self._next = 0

    def submit(
        self, src: Any, dst: Any, nbytes: Any, keys: Any, band: Band
    ) -> npt.NDArray[np.int64]:
        out = []
        for s, d, n, k in zip(
            *(np.asarray(a, dtype=np.int64).reshape(-1) for a in (src, dst, nbytes, keys)),
            strict=True,
        ):
            k = int(k)
            self.submitted.append((k, band))
            t = self.ticket_of_key.get(k)
            if t is not None and t not in self.done:
                src0, dst0, n0, _, b0 = self.queue[t]
                self.queue[t] = (src0, dst0, n0, k, min(b0, band))
                out.append(t)
                continue
            t = self._next
            self._next += 1
            self.queue[t] = (int(s), int(d), int(n), k, band)
            self.ticket_of_key[k] = t
            out.append(t)
            if self.eager:
                self._run(t)
        return np.asarray(out, dtype=np.int64)

    def _run(self, t: int) -> None:
        if t in self.done:
            return
        s, d, n, k, _ = self.queue[t]
        if k in self.fail_keys:
            raise RuntimeError(f"copy {k} failed")
        ctypes.memmove(d, s, n)
        self.done.add(t)

    def poll(self, tickets: Any) -> npt.NDArray[np.bool_]:
        return np.asarray(
            [int(t) in self.done for t in np.asarray(tickets).reshape(-1)], dtype=np.bool_
        )

    def wait(self, tickets: Any, timeout_s: float | None = None) -> None:
        for t in np.asarray(tickets, dtype=np.int64).reshape(-1).tolist():
            self._run(t)

    def stream_wait(self, tickets: Any, stream_handle: int) -> None:
        self.wait(tickets)

    def cancel(self, band: Band | None = None) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"copies": len(self.done)}

    def close(self) -> None:
        pass


def reference_model(path: Path) -> Any:
    """The checkpoint at ``path`` as transformers runs it, the reference:
    float32, eager attention and experts, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def token_ids(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` seeded random token ids of the tiny presets' vocabulary (128)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g)


def small_gpu_overrides(arch: str) -> dict[str, Any]:
    """Config overrides of a small ``qwen3_moe`` / ``gpt_oss`` checkpoint for
    the GPU tests: hidden 256, 32 experts of width 512, top-4."""
    overrides: dict[str, Any] = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    if arch == "qwen3_moe":
        overrides.update(moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4)
    else:
        overrides.update(intermediate_size=512, num_local_experts=32, num_experts_per_tok=4)
    return overrides


def evicting_adapter(path: Path, issuer: object, **kw: Any) -> Any:
    """The checkpoint at ``path`` with the smallest legal expert cache of the
    tiny shapes: min(E=8, top_k=2 x max_batch_tokens=2) = 4 slots, so a
    forward of more tokens routes more experts than it holds and evicts
    within a layer; eager attention, as :func:`reference_model`. ``kw``: more
    :func:`~pdflash.models.load_adapter` arguments."""
    from pdflash.models import load_adapter

    return load_adapter(
        path, issuer=issuer, cache_slots=4, max_batch_tokens=2, attn_implementation="eager", **kw
    )


@contextlib.contextmanager
def forced_host_service(ad: Any, host_format: str) -> Iterator[Any]:
    """``ad``'s hybrid host service computing every miss on the host
    (``ForcedHostPlanner(every=1)``, no calibration) in ``host_format``, for
    the block; closed and detached from the adapter after it."""
    from pdflash.hybrid import ForcedHostPlanner, build_host_service

    svc = build_host_service(
        ad,
        link_bytes_per_s=1e9,
        planner=ForcedHostPlanner(every=1),
        calibrate=False,
        host_format=host_format,
        weight_budget_bytes=1 << 34,
    )
    try:
        yield svc
    finally:
        svc.close()
        ad.runtime.host_service = None


def resident_adapter(path: Path, issuer: object) -> Any:
    """The checkpoint at ``path`` loaded with every expert resident (cache
    fraction 1.0, each copied and waited for)."""
    from pdflash.models import load_adapter

    ad = load_adapter(path, issuer=issuer, cache_fraction=1.0)
    cache = ad.cache
    cache.wait_ready(cache.prefetch(np.arange(cache.num_ids)))
    assert cache.all_resident()
    return ad


@pytest.fixture
def fake_issuer() -> FakeIssuer:
    return FakeIssuer()


@pytest.fixture(scope="module")
def cuda_issuer() -> Iterator[Any]:
    """The real issuer on its CUDA backend, one per test module (GPU tests)."""
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="cuda")
    yield issuer
    issuer.close()


@pytest.fixture
def host_issuer() -> Iterator[Any]:
    """The real issuer on its host backend (memcpy from a C++ worker thread)."""
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="host")
    yield issuer
    issuer.close()


@pytest.fixture(scope="session")
def fake_issuer_cls() -> type[FakeIssuer]:
    return FakeIssuer


@pytest.fixture(scope="session")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 (blocks and scales),
    as the released gpt-oss checkpoints store them."""
    from pdflash.models import write_synthetic_checkpoint

    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("mx") / "g", "gpt_oss", "tiny", expert_format="mxfp4", seed=3
    )


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pdflash.models import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {
        arch: write_synthetic_checkpoint(
            root / arch, arch, "tiny", dtype=torch.float32, seed=1, shard_bytes=20_000
        )
        for arch in ARCHS
    }
