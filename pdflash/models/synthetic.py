"""Synthetic Hugging Face checkpoints with seeded random weights.

:func:`write_synthetic_checkpoint` writes ``config.json`` + sharded
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` in
the architecture's hub naming (per-expert tensors for qwen3_moe / olmoe /
mixtral, fused 3-D bf16 experts for gpt-oss, or gpt-oss MXFP4 blocks/scales
with ``expert_format="mxfp4"``), loadable by transformers'
``from_pretrained`` and by pdflash through the same code path as a real
checkpoint. ``config.json`` carries ``"pdflash_synthetic"`` (preset, seed)
so results computed on it are labelled synthetic. A small character-level
tokenizer with a ChatML chat template is written next to it
(:func:`pdflash.text.write_synthetic_tokenizer`).

Presets: ``tiny`` per architecture (CPU tests); ``small`` for gpt_oss and
qwen3_moe (published expert-count/top-k ratios at a CPU-sized hidden size, so
an emulated-link CPU run is link-bound like the full shapes on a GPU); and the published shapes
``qwen3-30b-a3b``, ``gpt-oss-20b``, ``mixtral-8x7b``, ``olmoe-1b-7b``;
``num_layers`` truncates (full-size checkpoints are tens of GB).

Weights: matrices ``N(0, 1/fan_in)`` so activations stay O(1) at any
scale, norms ``1 + N(0, 0.1^2)``, biases and sinks small. Each tensor is drawn
from its own generator seeded by ``(seed, tensor name)``, so a tensor does not
depend on sharding or write order (values differ between ``device="cpu"``
and ``"cuda"`` generation).

Hook: ``on_written(path, config)`` runs after the checkpoint is complete;
the engine's synthetic DFlash drafter writer can use it to add its files.

:func:`cached_synthetic_checkpoint` writes a checkpoint once under a cache
directory (named by the digest of the writer's arguments, the generating
device, this module's source and the torch/transformers versions) and reuses
it afterwards; :func:`cached_directory` is its keyed, atomic mechanism, which
the engine's benchmark harness also uses for a target and its drafter.

``weights="generated"`` writes only ``config.json`` (and the tokenizer): its
``pdflash_synthetic`` block says the tensors are generated when read, and
:func:`pdflash.models.store.open_checkpoint` then opens it as a
:class:`GeneratedCheckpoint`, which draws each tensor with the same
per-tensor generator as the writer, so pdflash loads bit-identical weights
without writing and reading them back (benchmarks of full-size shapes that
do not test the loading path; transformers cannot load such a directory).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from pdflash.models.store import INDEX_FILE, CheckpointError, SafetensorsCheckpoint


def _gpt_oss_yarn(factor: float, original_max: int) -> dict[str, Any]:
    """gpt-oss's YaRN rope settings, scaled by ``factor`` from
    ``original_max`` positions."""
    return {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": factor,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": original_max,
    }


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_moe": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=256,
        ),
        "small": dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=192,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=1024,
        ),
        "qwen3-30b-a3b": dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
        ),
    },
    "gpt_oss": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=4,
            max_position_embeddings=256,
            rope_parameters=_gpt_oss_yarn(factor=4.0, original_max=64),
        ),
        "small": dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            max_position_embeddings=1024,
            rope_parameters=_gpt_oss_yarn(factor=4.0, original_max=256),
        ),
        "gpt-oss-20b": dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            swiglu_limit=7.0,
            rope_parameters=_gpt_oss_yarn(factor=32.0, original_max=4096),
        ),
    },
    "mixtral": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=256,
        ),
        "mixtral-8x7b": dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=None,
        ),
    },
    "olmoe": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=256,
            clip_qkv=3.0,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=2,
        ),
        "olmoe-1b-7b": dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=50279,
        ),
    },
    # a shared expert with a sigmoid gate beside the routed experts
    "qwen2_moe": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=256,
        ),
    },
    # a dense first layer, an ungated shared expert, grouped sigmoid routing
    # with bias correction, partial rotary, q/k norms and biases
    "glm4_moe": {
        "tiny": dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
            max_position_embeddings=256,
        ),
    },
}

#: a published-shape preset name -> its architecture
PRESET_ARCH: dict[str, str] = {
    name: arch
    for arch, presets in PRESETS.items()
    for name in presets
    if name not in ("tiny", "small")
}


def synthetic_config(
    arch: str, preset: str = "tiny", *, num_layers: int | None = None, **overrides: Any
) -> Any:
    """The transformers config of a preset, optionally layer-truncated."""
    from transformers import AutoConfig

    from pdflash.models.adapters import get_adapter_class

    get_adapter_class(arch)  # unknown arch -> clear error
    try:
        kwargs = dict(PRESETS[arch][preset])
    except KeyError:
        raise ValueError(
            f"no synthetic preset {preset!r} for {arch}; choose from {sorted(PRESETS[arch])}"
        ) from None
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        kwargs["num_hidden_layers"] = int(num_layers)
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF


def _fill(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str, fan_in: int
) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(_seed_of(seed, name))
    if dtype == torch.uint8:  # MXFP4 blocks / scales
        if name.endswith("_scales"):
            # 2^(s-127) ~ 2^-7: e2m1 values (|v| <= 6) * 2^-7 ~ N(0, 1/fan_in) scale for fan_in ~ 3k
            return torch.randint(
                119, 122, shape, generator=gen, device=device, dtype=torch.uint8
            ).cpu()
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8).cpu()
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    # in place: the same elementwise ops (bit-identical values) without a
    # second full-size float32 buffer
    base = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        x.mul_(0.1).add_(1.0)
    elif name.endswith("embed_tokens.weight"):
        pass
    elif base.endswith("bias") or base == "sinks":
        x.mul_(0.1)
    else:
        x.div_(math.sqrt(max(fan_in, 1)))
    return x.to(dtype).cpu()


def _tensor_specs(
    arch: str, config: Any, dtype: torch.dtype, expert_format: str | None
) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """(checkpoint name, shape, dtype, fan_in) of every tensor the checkpoint
    holds (no ``lm_head.weight`` where it is tied to the embeddings), in
    write order."""
    from transformers import AutoModelForCausalLM

    from pdflash.models.adapters import get_adapter_class

    cls = get_adapter_class(arch)
    cls.validate_config(config)
    formats = cls.expert_formats(config)
    if expert_format is None:
        fmt = formats[0]
    else:
        by_name = {f.name: f for f in formats}
        if expert_format not in by_name:
            raise ValueError(
                f"{arch} has no expert format {expert_format!r}; choose from {sorted(by_name)}"
            )
        fmt = by_name[expert_format]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    num_experts = cls.num_experts_of(config)
    specs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
    for mkey, t in model.state_dict().items():
        if ".mlp.experts." in mkey:
            continue
        shape = tuple(int(d) for d in t.shape)
        specs.append((cls.module_to_checkpoint_key(mkey), shape, dtype, shape[-1]))
    # NOTE: gpt-oss experts compute x @ W (fan-in is dim -2); the others F.linear (dim -1).
    fan_in_dim = -2 if arch == "gpt_oss" else -1
    seen: set[str] = set()
    for layer in range(len(cls.moe_layer_indices(config))):  # MoE layers only
        for expert in range(num_experts):
            for p in fmt.parts(layer, expert):
                if p.key in seen:
                    continue
                seen.add(p.key)
                lead = () if p.index is None else (num_experts,)
                if p.transform == "mxfp4":
                    assert p.scales_key is not None
                    specs.append((p.key, (*lead, *p.shape), torch.uint8, 0))
                    specs.append((p.scales_key, (*lead, *p.shape[:-1]), torch.uint8, 0))
                else:
                    fan_in = p.shape[fan_in_dim] if len(p.shape) > 1 else 1
                    specs.append((p.key, (*lead, *p.shape), dtype, fan_in))
    if bool(getattr(config, "tie_word_embeddings", False)):
        specs = [s for s in specs if s[0] != "lm_head.weight"]
    return specs


#: ``pdflash_synthetic["weights"]`` of a checkpoint without tensor files
GENERATED = "generated"
WEIGHTS_CHOICES = ("files", GENERATED)


def _check_weights(weights: str) -> None:
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHTS_CHOICES}, got {weights!r}")


def write_synthetic_checkpoint(
    path: str | os.PathLike[str],
    arch: str,
    preset: str = "tiny",
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shard_bytes: int = 1 << 30,
    expert_format: str | None = None,
    device: str = "cpu",
    config_overrides: dict[str, Any] | None = None,
    on_written: Callable[[Path, Any], None] | None = None,
    weights: str = "files",
) -> Path:
    """Write a synthetic checkpoint to ``path`` (created); returns it.

    ``expert_format``: the adapter's format name (default: the hub naming;
    ``"mxfp4"`` for gpt-oss MXFP4 experts). ``device``: where random values
    are generated (``cuda`` is much faster for full-size shapes).
    ``weights``: ``files`` (safetensors shards) or ``generated`` (no tensor
    files: pdflash generates the same tensors when it loads the directory,
    see :class:`GeneratedCheckpoint`).
    """
    _check_weights(weights)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = synthetic_config(arch, preset, num_layers=num_layers, **(config_overrides or {}))
    config.dtype = dtype
    if expert_format == "mxfp4":
        config.quantization_config = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    specs = _tensor_specs(arch, config, dtype, expert_format)
    if weights == GENERATED:
        specs = []  # nothing to write: the loader draws every tensor
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    tmp_names: list[Path] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        tmp = out / f".shard-{len(tmp_names)}.tmp"
        save_file(current, str(tmp), metadata={"format": "pt"})
        tmp_names.append(tmp)
        shards.append(list(current))
        current, current_bytes = {}, 0

    total = 0
    for name, shape, dt, fan_in in specs:
        t = _fill(name, shape, dt, seed, device, fan_in)
        nb = t.numel() * t.element_size()
        if current and current_bytes + nb > shard_bytes:
            flush()
        current[name] = t
        current_bytes += nb
        total += nb
    flush()

    n = len(tmp_names)
    weight_map: dict[str, str] = {}
    for i, (tmp, names) in enumerate(zip(tmp_names, shards, strict=True)):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tmp.replace(out / final)
        weight_map.update(dict.fromkeys(names, final))
    if n > 1:
        (out / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    config.save_pretrained(out)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["pdflash_synthetic"] = {
        "preset": preset,
        "seed": seed,
        "expert_format": expert_format or "hub",
        "generated_on": device,
        "weights": weights,
        "note": "synthetic random weights, not a trained model",
    }
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True))
    # a tokenizer too, so the checkpoint can be served as text (pdflash serve)
    from pdflash.text import write_synthetic_tokenizer

    write_synthetic_tokenizer(out, int(config.vocab_size))
    if on_written is not None:
        on_written(out, config)
    return out


#: the marker a complete cached directory carries (its text: the key)
CACHE_MARKER = "PDFLASH_SYNTHETIC_COMPLETE"


def source_digest(module_name: str) -> str:
    """A short digest of a module's source: the part of a cache key that
    stands for the code writing what is cached (an edited writer writes anew)."""
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    try:
        source = inspect.getsource(module).encode()
    except (OSError, TypeError):  # installed without its .py: the compiled file
        source = Path(str(module.__file__)).read_bytes()
    return hashlib.sha256(source).hexdigest()[:16]


def _host_tag() -> str:
    """This host, in a temporary directory's name (a process id means
    something on its own host only: a cache may be on a shared disk)."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _remove_abandoned_writes(base: Path, name: str) -> None:
    """Remove the temporary siblings of ``name`` whose writer (a process of
    this host, named in the sibling's name) is gone: a killed write leaves
    its partial directory, possibly tens of GB, behind."""
    host = _host_tag()
    for tmp in base.glob(f".{glob.escape(name)}.{host}.*"):
        pid_text = tmp.name[len(name) + len(host) + 3 :].split(".", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def cached_directory(
    root: str | os.PathLike[str],
    name: str,
    key: Mapping[str, Any],
    write: Callable[[Path], object],
) -> tuple[Path, bool]:
    """The directory ``root / f"{name}-{digest}"`` written once by
    ``write(directory)`` and reused while ``key`` (JSON-ready: everything the
    contents depend on) is unchanged; returns ``(path, reused)``. The digest
    is the key's, so a changed key names another directory; the key's text
    is the completion marker (:data:`CACHE_MARKER`), so a directory whose
    marker is missing or differs is written again. ``write`` fills a
    temporary sibling, renamed into place once complete: an interrupted or
    failed write is never reused and leaves nothing behind (a killed
    writer's sibling is removed by the next write of the same name on its
    host)."""
    text = json.dumps(dict(key), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    base = Path(root)
    final = base / f"{name}-{digest}"
    marker = final / CACHE_MARKER

    def complete() -> bool:
        return marker.is_file() and marker.read_text() == text

    if complete():
        return final, True
    base.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_writes(base, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{_host_tag()}.{os.getpid()}.", dir=base))
    try:
        write(tmp)
        (tmp / CACHE_MARKER).write_text(text)
        if not complete():  # another process may have completed it meanwhile
            if final.exists():  # an incomplete (or stale) copy: replaced by this one
                shutil.rmtree(final)
            try:
                tmp.rename(final)
            except OSError:
                if not complete():
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, False


def synthetic_cache_key(
    arch: str,
    preset: str = "tiny",
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shard_bytes: int = 1 << 30,
    expert_format: str | None = None,
    device: str = "cpu",
    weights: str = "files",
) -> dict[str, Any]:
    """What a written synthetic checkpoint depends on: the writer's arguments
    (the generating device among them: CPU and CUDA random streams differ),
    this module's source (the presets, the generators, the writer), and the
    torch and transformers versions (random streams and the configs' files
    may change between them)."""
    import transformers

    return {
        "arch": arch,
        "preset": preset,
        "num_layers": num_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": int(seed),
        "shard_bytes": int(shard_bytes),
        "expert_format": expert_format,
        "device": device,
        "weights": weights,
        "writer": source_digest(__name__),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def synthetic_cache_name(key: Mapping[str, Any]) -> str:
    """A readable directory name for a cached synthetic checkpoint, from its
    :func:`synthetic_cache_key` (the key's digest follows it)."""
    layers = key["num_layers"]
    name = (
        f"{key['arch']}-{key['preset']}-L{layers if layers is not None else 'all'}"
        f"-{key['dtype']}-s{key['seed']}-{key['expert_format'] or 'hub'}-{key['device']}"
    )
    return name if key["weights"] == "files" else f"{name}-{key['weights']}"


def cached_synthetic_checkpoint(
    root: str | os.PathLike[str],
    arch: str,
    preset: str = "tiny",
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shard_bytes: int = 1 << 30,
    expert_format: str | None = None,
    device: str = "cpu",
    weights: str = "files",
) -> tuple[Path, bool]:
    """The synthetic checkpoint of these arguments under ``root``, written
    there once (:func:`write_synthetic_checkpoint`) and reused while its key
    (:func:`synthetic_cache_key`) is unchanged; returns ``(path, reused)``.
    The directory is named by the key's digest, so a changed argument, writer
    or library version writes a new one; it is written into a temporary
    sibling and renamed into place once complete (:func:`cached_directory`),
    so an interrupted write is never reused."""
    _check_weights(weights)
    # the writer's arguments, once: the key and the write take the same ones
    writer_args: dict[str, Any] = dict(
        num_layers=num_layers, dtype=dtype, seed=seed, shard_bytes=shard_bytes,
        expert_format=expert_format, device=device, weights=weights,
    )  # fmt: skip
    key = synthetic_cache_key(arch, preset, **writer_args)

    def write(tmp: Path) -> None:
        write_synthetic_checkpoint(tmp, arch, preset, **writer_args)

    return cached_directory(root, name=synthetic_cache_name(key), key=key, write=write)


def is_generated(path: str | os.PathLike[str]) -> bool:
    """True for a synthetic checkpoint directory whose tensors are generated
    when read (written with ``weights="generated"``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        meta = json.loads(cfg.read_text()).get("pdflash_synthetic")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(meta, dict) and meta.get("weights") == GENERATED


class _GeneratedHandle:
    """A stand-in for a safetensors file handle over one generated tensor
    (drawn once per handle: per-expert slices of a fused tensor share it)."""

    def __init__(self, checkpoint: GeneratedCheckpoint, key: str) -> None:
        self.checkpoint = checkpoint
        self.key = key
        self._tensor: torch.Tensor | None = None

    def __enter__(self) -> _GeneratedHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tensor = None

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._tensor is not None and key == self.key:
            return self._tensor
        return self.checkpoint.generate(key)

    def get_slice(self, key: str) -> torch.Tensor:
        if key != self.key:
            return self.checkpoint.generate(key)
        if self._tensor is None:
            self._tensor = self.checkpoint.generate(key)
        return self._tensor


class GeneratedCheckpoint(SafetensorsCheckpoint):
    """A synthetic checkpoint read without tensor files: every tensor is
    drawn when read, by the writer's own generator for its name
    (:func:`_fill`, on the device recorded as ``generated_on``), so the
    values are bit-identical to those :func:`write_synthetic_checkpoint`
    writes for the same arguments. Same interface as
    :class:`~pdflash.models.store.SafetensorsCheckpoint`; ``file_of`` names
    a pseudo-file per tensor (for error texts and per-tensor handles)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoConfig

        self.path = Path(path)
        if not is_generated(self.path):
            raise CheckpointError(f"{self.path}: not a synthetic checkpoint with generated weights")
        raw = json.loads((self.path / "config.json").read_text())
        meta = raw["pdflash_synthetic"]
        config = AutoConfig.from_pretrained(self.path)
        dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))
        fmt = meta.get("expert_format")
        specs = _tensor_specs(
            str(config.model_type), config, dtype, None if fmt in (None, "hub") else str(fmt)
        )
        self.seed = int(meta["seed"])
        self.device = str(meta.get("generated_on", "cpu"))
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise CheckpointError(
                f"{self.path}: its weights are generated on {self.device}, which this machine "
                "lacks (values differ between CPU and CUDA generation)"
            )
        self._specs = {name: (shape, dt, fan_in) for name, shape, dt, fan_in in specs}
        self.weight_map = dict.fromkeys(self._specs, GENERATED)
        self._meta = {}

    def file_of(self, key: str) -> Path:
        if key not in self._specs:
            raise CheckpointError(f"{self.path}: tensor {key!r} not found in the checkpoint")
        return self.path / f"<generated {key}>"

    def shape(self, key: str) -> tuple[int, ...]:
        self.file_of(key)
        return self._specs[key][0]

    def dtype(self, key: str) -> torch.dtype:
        self.file_of(key)
        return self._specs[key][1]

    def _open(self, key: str) -> Any:
        self.file_of(key)
        return _GeneratedHandle(self, key)

    def generate(self, key: str) -> torch.Tensor:
        """The tensor ``key`` as the writer draws it."""
        shape, dt, fan_in = self._specs[key]
        return _fill(key, shape, dt, self.seed, self.device, fan_in)
