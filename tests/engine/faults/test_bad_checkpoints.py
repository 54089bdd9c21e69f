"""Corrupt checkpoints (issue 12, item 2): an invalid config.json, a bad
config value, a corrupt or missing safetensors shard and NaN/Inf weights are
each refused with an error naming the file (and the key or tensor), for the
target (:func:`pdflash.models.load_adapter`) and the DFlash drafter
(:func:`pdflash.engine.drafter.load_drafter`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import Ledger, classify_refusal

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

SINGLE = "model.safetensors"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny qwen3_moe target (single file and sharded) and a drafter for it."""
    from pdflash.engine.drafter import write_synthetic_drafter
    from pdflash.models import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("pristine")
    single = root / "single"
    write_synthetic_checkpoint(single, "qwen3_moe", "tiny", num_layers=2, dtype=torch.float32)
    sharded = root / "sharded"
    shutil.copytree(single, sharded)
    tensors = load_file(sharded / SINGLE)
    (sharded / SINGLE).unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in zip(SHARDS, (names[:half], names[half:]), strict=True):
        save_file({n: tensors[n] for n in part}, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    drafter = root / "drafter"
    cfg = json.loads((single / "config.json").read_text())
    write_synthetic_drafter(drafter, cfg, "tiny", seed=2, dtype=torch.float32)
    return {"single": single, "sharded": sharded, "drafter": drafter}


# ------------------------------------------------------------- mutations


def set_config(**changes: Any) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        for k, v in changes.items():
            if v is _DROP:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (path / "config.json").write_text(json.dumps(cfg))

    return apply


_DROP = object()


def write_text(name: str, text: str) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        (path / name).write_text(text)

    return apply


def write_bytes(name: str, make: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(make(data))

    return apply


def delete(name: str) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        (path / name).unlink()

    return apply


def edit_tensor(file: str, key: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Any:
    def apply(path: Path) -> None:
        tensors = load_file(path / file)
        out = fn(tensors[key].clone())
        if out is None:
            del tensors[key]
        else:
            tensors[key] = out
        save_file(tensors, path / file, metadata={"format": "pt"})

    return apply


def add_tensor(file: str, key: str) -> Any:
    def apply(path: Path) -> None:
        tensors = load_file(path / file)
        tensors[key] = torch.zeros(3)
        save_file(tensors, path / file, metadata={"format": "pt"})

    return apply


def poison(value: float, index: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[index] = value
        return t

    return fn


def _header_len_huge(data: bytes) -> bytes:
    return (2**40).to_bytes(8, "little") + data[8:]


def _header_garbage(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[:8] + b"\x00{" * (n // 2) + data[8 + 2 * (n // 2) :]


NAN, INF = float("nan"), float("inf")

# (case, which checkpoint, mutation, text the error must contain)
TARGET_CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("config_not_json", "single", write_text("config.json", "{not json"), "config.json"),
    ("config_empty", "single", write_text("config.json", ""), "config.json"),
    ("config_list", "single", write_text("config.json", "[1, 2]"), "config.json"),
    ("config_null", "single", write_text("config.json", "null"), "config.json"),
    (
        "config_binary",
        "single",
        write_bytes("config.json", lambda d: b"\xff\xfe" + d),
        "config.json",
    ),
    ("config_missing", "single", delete("config.json"), "config.json"),
    ("missing_model_type", "single", set_config(model_type=_DROP), "model_type"),
    ("unknown_model_type", "single", set_config(model_type="llama"), "llama"),
    ("missing_hidden_size", "single", set_config(hidden_size=_DROP), "hidden_size"),
    ("missing_num_layers", "single", set_config(num_hidden_layers=_DROP), "num_hidden_layers"),
    ("missing_vocab_size", "single", set_config(vocab_size=_DROP), "vocab_size"),
    ("missing_heads", "single", set_config(num_attention_heads=_DROP), "num_attention_heads"),
    ("missing_top_k", "single", set_config(num_experts_per_tok=_DROP), "num_experts_per_tok"),
    ("rms_norm_eps_zero", "single", set_config(rms_norm_eps=0.0), "rms_norm_eps"),
    ("rms_norm_eps_negative", "single", set_config(rms_norm_eps=-1e-6), "rms_norm_eps"),
    ("rms_norm_eps_nan", "single", set_config(rms_norm_eps=NAN), "rms_norm_eps"),
    ("rms_norm_eps_str", "single", set_config(rms_norm_eps="tiny"), "rms_norm_eps"),
    ("hidden_size_zero", "single", set_config(hidden_size=0), "hidden_size"),
    ("hidden_size_negative", "single", set_config(hidden_size=-32), "hidden_size"),
    ("hidden_size_float", "single", set_config(hidden_size=31.5), "hidden_size"),
    ("hidden_size_bool", "single", set_config(hidden_size=True), "hidden_size"),
    ("num_layers_zero", "single", set_config(num_hidden_layers=0), "num_hidden_layers"),
    ("heads_zero", "single", set_config(num_attention_heads=0), "num_attention_heads"),
    ("kv_heads_not_dividing", "single", set_config(num_key_value_heads=3), "num_key_value_heads"),
    ("kv_heads_zero", "single", set_config(num_key_value_heads=0), "num_key_value_heads"),
    ("head_dim_zero", "single", set_config(head_dim=0), "head_dim"),
    (
        "hidden_not_multiple_of_heads",
        "single",
        set_config(head_dim=None, num_attention_heads=5, num_key_value_heads=5),
        "num_attention_heads",
    ),
    ("vocab_zero", "single", set_config(vocab_size=0), "vocab_size"),
    ("top_k_zero", "single", set_config(num_experts_per_tok=0), "num_experts_per_tok"),
    ("top_k_above_experts", "single", set_config(num_experts_per_tok=9), "num_experts_per_tok"),
    ("no_experts", "single", set_config(num_local_experts=0, num_experts=0), "experts"),
    ("max_positions_zero", "single", set_config(max_position_embeddings=0), "max_position"),
    ("moe_intermediate_zero", "single", set_config(moe_intermediate_size=0), "moe_intermediate"),
    ("shape_mismatch_hidden", "single", set_config(hidden_size=64), "shape"),
    ("shard_truncated", "single", write_bytes(SINGLE, lambda d: d[: len(d) // 2]), SINGLE),
    ("shard_garbage", "single", write_bytes(SINGLE, lambda d: bytes(len(d))), SINGLE),
    ("shard_empty", "single", write_bytes(SINGLE, lambda d: b""), SINGLE),
    ("shard_header_len_huge", "single", write_bytes(SINGLE, _header_len_huge), SINGLE),
    ("shard_header_garbage", "single", write_bytes(SINGLE, _header_garbage), SINGLE),
    ("shard_missing", "single", delete(SINGLE), SINGLE),
    ("sharded_first_truncated", "sharded", write_bytes(SHARDS[0], lambda d: d[:100]), SHARDS[0]),
    ("sharded_second_garbage", "sharded", write_bytes(SHARDS[1], lambda d: b"x" * 64), SHARDS[1]),
    ("sharded_second_missing", "sharded", delete(SHARDS[1]), SHARDS[1]),
    ("index_not_json", "sharded", write_text(INDEX, "{"), INDEX),
    ("index_no_weight_map", "sharded", write_text(INDEX, '{"metadata": {}}'), INDEX),
    (
        "tensor_wrong_shape",
        "single",
        edit_tensor(SINGLE, "model.norm.weight", lambda t: t[:-1]),
        "model.norm.weight",
    ),
    (
        "tensor_missing",
        "single",
        edit_tensor(SINGLE, "model.norm.weight", lambda t: None),
        "model.norm.weight",
    ),
    ("expert_missing", "single", edit_tensor(SINGLE, EXPERT, lambda t: None), EXPERT),
    ("tensor_unexpected", "single", add_tensor(SINGLE, "model.layers.0.mlp.dense.weight"), "dense"),
    ("nan_expert", "single", edit_tensor(SINGLE, EXPERT, poison(NAN, 5)), EXPERT),
    (
        "inf_expert_sharded",
        "sharded",
        edit_tensor(SHARDS[0], "model.layers.0.mlp.experts.0.down_proj.weight", poison(INF)),
        "experts.0.down_proj",
    ),
    (
        "nan_embedding",
        "single",
        edit_tensor(SINGLE, "model.embed_tokens.weight", poison(NAN, 7)),
        "embed_tokens",
    ),
    ("neg_inf_lm_head", "single", edit_tensor(SINGLE, "lm_head.weight", poison(-INF)), "lm_head"),
    (
        "nan_layernorm",
        "single",
        edit_tensor(SINGLE, "model.layers.1.input_layernorm.weight", poison(NAN)),
        "input_layernorm",
    ),
    (
        "nan_router",
        "single",
        edit_tensor(SINGLE, "model.layers.1.mlp.gate.weight", poison(NAN, 3)),
        "mlp.gate",
    ),
]

D_SINGLE = "model.safetensors"


def drop_mask_token(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("mask_token_id", None)
    (cfg.get("dflash_config") or {}).pop("mask_token_id", None)
    (path / "config.json").write_text(json.dumps(cfg))


DRAFTER_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("config_not_json", write_text("config.json", "{{"), "config.json"),
    ("config_list", write_text("config.json", "[]"), "config.json"),
    ("missing_mask_token", drop_mask_token, "mask_token_id"),
    ("missing_hidden_size", set_config(hidden_size=_DROP), "hidden_size"),
    ("hidden_size_str", set_config(hidden_size="big"), "config.json"),
    ("rms_norm_eps_zero", set_config(rms_norm_eps=0.0), "rms_norm_eps"),
    ("heads_zero", set_config(num_attention_heads=0), "num_attention_heads"),
    ("kv_heads_not_dividing", set_config(num_key_value_heads=3), "num_key_value_heads"),
    ("unknown_dtype", set_config(torch_dtype="float7", dtype=_DROP), "float7"),
    ("shard_garbage", write_bytes(D_SINGLE, lambda d: b"\x07" * len(d)), D_SINGLE),
    ("shard_truncated", write_bytes(D_SINGLE, lambda d: d[: len(d) // 3]), D_SINGLE),
    ("shard_missing", delete(D_SINGLE), D_SINGLE),
    ("nan_fc", edit_tensor(D_SINGLE, "fc.weight", poison(NAN)), "fc.weight"),
    (
        "inf_layer",
        edit_tensor(D_SINGLE, "layers.0.mlp.down_proj.weight", poison(INF, 2)),
        "down_proj",
    ),
]


def _copy(pristine: dict[str, Path], which: str, tmp_path: Path) -> Path:
    dst = tmp_path / which
    shutil.copytree(pristine[which], dst)
    return dst


def _load_target(path: Path, **kw: Any) -> Any:
    from pdflash.models import load_adapter

    return load_adapter(path, device="cpu", **kw)


@pytest.mark.parametrize(
    ("case", "which", "mutate", "mention"), TARGET_CASES, ids=[c[0] for c in TARGET_CASES]
)
def test_corrupt_target_checkpoint_is_refused(
    case: str,
    which: str,
    mutate: Callable[[Path], None],
    mention: str,
    pristine: dict[str, Path],
    tmp_path: Path,
    ledger: Ledger,
) -> None:
    path = _copy(pristine, which, tmp_path)
    mutate(path)
    outcome, detail = classify_refusal(
        lambda: _load_target(path), (ValueError, FileNotFoundError), mention
    )
    if outcome == "clear_error" and str(path) not in detail and path.name not in detail:
        outcome, detail = "crashed", f"error does not name the checkpoint path: {detail}"
    ledger.record("bad_checkpoint", case, outcome, detail)
    assert outcome == "clear_error", detail


@pytest.mark.parametrize(
    ("case", "mutate", "mention"), DRAFTER_CASES, ids=[c[0] for c in DRAFTER_CASES]
)
def test_corrupt_drafter_checkpoint_is_refused(
    case: str,
    mutate: Callable[[Path], None],
    mention: str,
    pristine: dict[str, Path],
    tmp_path: Path,
    ledger: Ledger,
) -> None:
    from pdflash.engine.drafter import load_drafter

    path = _copy(pristine, "drafter", tmp_path)
    mutate(path)
    outcome, detail = classify_refusal(
        lambda: load_drafter(path), (ValueError, FileNotFoundError), mention
    )
    ledger.record("bad_drafter", case, outcome, detail)
    assert outcome == "clear_error", detail


def test_check_finite_opt_out_loads_nan_weights(pristine: dict[str, Path], tmp_path: Path) -> None:
    from pdflash.engine.drafter import load_drafter

    path = _copy(pristine, "single", tmp_path)
    edit_tensor(SINGLE, EXPERT, poison(NAN, 5))(path)
    edit_tensor(SINGLE, "model.embed_tokens.weight", poison(NAN, 7))(path)
    ad = _load_target(path, check_finite=False)
    assert torch.isnan(ad.hf_model.model.embed_tokens.weight).any()
    assert torch.isnan(ad.store.buffer.view(torch.float32)).any()
    dpath = _copy(pristine, "drafter", tmp_path)
    edit_tensor(D_SINGLE, "fc.weight", poison(NAN))(dpath)
    assert torch.isnan(load_drafter(dpath, check_finite=False).fc.weight).any()


def test_pristine_checkpoints_load(pristine: dict[str, Path]) -> None:
    from pdflash.engine.drafter import load_drafter

    a = _load_target(pristine["single"])
    b = _load_target(pristine["sharded"])
    torch.testing.assert_close(a.store.buffer, b.store.buffer)
    load_drafter(pristine["drafter"])
