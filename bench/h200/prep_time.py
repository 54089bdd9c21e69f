"""Time host weight preparation (``host_weights_for``) for one format on a
synthetic gpt-oss checkpoint, in a fresh process; prints one JSON line.

Usage: python -P bench/h200/prep_time.py --preset tiny|gpt-oss-20b
--layers N --experts E --fmt native|auto|... [--device cuda] [--digest]
[--prepare-threads N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--fmt", default="native")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--digest", action="store_true", help="hash of every prepared tensor")
    p.add_argument("--dir", default=None, help="checkpoint directory (reused)")
    p.add_argument("--device", default="cpu", help="the adapter's device (cuda: prepare there)")
    p.add_argument(
        "--prepare-threads",
        type=int,
        default=None,
        help="PREPARE_MAX_THREADS and PREPARE_MAX_DEVICE_THREADS (default: as is)",
    )
    a = p.parse_args()
    from pdflash.h2d import H2DIssuer
    from pdflash.hybrid import host_weights_for, prepare
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    ckpt = Path(a.dir or tempfile.mkdtemp()) / f"{a.preset}-l{a.layers}-e{a.experts}"
    if not (ckpt / "config.json").is_file():
        over = {"num_local_experts": a.experts, "vocab_size": 1024}
        write_synthetic_checkpoint(
            ckpt,
            "gpt_oss",
            a.preset,
            num_layers=a.layers,
            config_overrides=over,
            weights="generated",
        )
    if a.prepare_threads is not None and hasattr(prepare, "PREPARE_MAX_THREADS"):
        prepare.PREPARE_MAX_THREADS = a.prepare_threads
        prepare.PREPARE_MAX_DEVICE_THREADS = a.prepare_threads
    cuda = a.device.startswith("cuda")
    issuer = H2DIssuer(backend="cuda" if cuda else "host")
    ad = load_adapter(ckpt, device=a.device, issuer=issuer, cache_slots=4, max_batch_tokens=1)
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    hw = host_weights_for(ad, a.fmt, budget_bytes=1 << 36)
    if prof:
        prof.disable()
    total = time.perf_counter() - t0
    row = {
        "fmt": a.fmt,
        "chosen": hw.format,
        "layers": a.layers,
        "experts": a.experts,
        "preset": a.preset,
        "threads": torch.get_num_threads(),
        "total_s": total,
        "prepare_s": hw.prepare_s,
        "select_s": hw.select_s,
        "nbytes": hw.nbytes,
        "candidates": hw.candidates,
        "device": a.device,
        "prepare_threads": getattr(prepare, "PREPARE_MAX_THREADS", None),
        "sample_reused": getattr(hw, "sample_reused", None),
    }
    if a.digest:
        h = hashlib.sha256()
        for g in ad.store.packed_ids().tolist():
            for k, t in sorted(hw.weights_of(int(g)).items()):
                h.update(k.encode())
                if t.is_mkldnn:  # oneDNN's opaque prepacked tensors: their values
                    t = t.to_dense()
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        row["digest"] = h.hexdigest()
    print(json.dumps(row))
    if prof:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    hw.close()
    issuer.close()


if __name__ == "__main__":
    main()
