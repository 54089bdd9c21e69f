"""GPU probe (bench only, issue 13): the hand-written CUDA MXFP4 grouped GEMM
(the library's ``cuda/src/mxfp4_moe_gemm.cu``, built here on its own) against
the Triton ``grouped_qgemm`` (``mxfp4_dot="scaled"``), for the library
variants selected by name (``--variants`` or ``MXC_VARIANTS``, e.g.
``v4,v8,v10``; default all; measurements so far: ``README.md`` here).

1. Builds ``cuda/src/mxfp4_moe_gemm.cu`` with nvcc (``-arch=sm_90a
   -DPDFLASH_MXFP4_GEMM_SM90A=1 -O3 --shared -Xcompiler -fPIC -Xptxas -v -I
   cuda/include``: the wgmma variants included; into /tmp/mxfp4_cuda; in
   the background while Triton autotunes); a failed build prints nvcc's
   output and exits 2, an unknown variant name exits 2 listing the names.
2. Correctness: random MXFP4 slabs at gpt-oss-20b's projection shapes with 8
   (or 4) experts (scale bytes 118..130; a wide 2..128 case (fast path, D = 0);
   a high 180..240 case (fast path, D = 112); an extreme case with scale bytes 0/1/2/3/200/240/253/254/255 in some rows),
   bias, random top-k routing, both epilogues, tokens 1/5/9/13/16/64/256,
   BLOCK_M 16/32/64, a dead tile (slot -1) inserted mid-list, row counts not
   divisible by 8, K = 2880 (90 blocks: a 2-block tail chunk), and a small odd
   slab (N 200 / 192, K = 96, no bias).
   Every selected CUDA variant that runs on the device (the wgmma ones:
   compute capability 9.0) is compared with a torch fp32 reference (dequantize,
   matmul, bias, epilogue, bf16 output) and with ``grouped_qgemm(scaled)``.
   Error metric: per output row, max |got - ref| / max |ref| over the row,
   then the max over rows (non-finite reference entries must match exactly:
   NaN where NaN, the same inf); PASS below TOL (2^-7 = two bf16 ulps at the
   row's largest output; bf16 rounding alone gives <= 2^-9).
3. Timing at gpt-oss-20b's expert shape (hidden 2880, gate_up 5760 x 2880,
   down 2880 x 2880, 32 experts, top-4; random routing) for 16 / 64 / 256
   tokens: the whole MLP (gate_up + SwiGLU epilogue, then down + bias) with
   each selected CUDA variant and with the Triton path, the tile map built as
   ``FusedSlabMLP.forward_slab`` does (``pick_block_m`` + the kernels'
   ``tile_map``, shared by both). Each implementation is captured in a CUDA
   graph of ITERS back-to-back MLPs (eager if capture fails); rounds are
   interleaved over implementations; the median per-MLP time of the rounds is
   reported. Roofline: the active experts' stored bytes (blocks + scales +
   biases of both projections) at the HBM bandwidth of a 1 GiB device copy
   measured in the same run (``pdflash.engine.roofline.measure_hbm_gbps``).
   Every timed implementation's output is checked against a fp32 reference.
   Also: each projection timed alone (gate_up, down, with their own
   rooflines), the Triton MLP timed alone before any CUDA-kernel launch (a
   baseline that survives a fault in the new kernel), and static SASS opcode
   counts per kernel (``cuobjdump``, where present).

Prints a table; writes everything as JSON to ``$OUT/mxfp4_cuda.json`` (OUT
default /tmp/out). Environment: ``MXC_VARIANTS`` (variant names ``vN`` or
indices, comma-separated, or ``all``; ``--variants`` overrides it),
``MXC_ROUNDS`` (15), ``MXC_ITERS`` (10),
``MXC_TOKENS`` (16,64,256), ``MXC_CORR_BUDGET_S`` (120: no new correctness
case after that many seconds of them, counted from the build's end, so a slow
nvcc does not skip them) / ``MXC_BUDGET_S`` (165: no new timing point after that
many seconds of timing, counted from the timing stage's start, so nvcc and the
correctness cases do not eat it),
``MXC_TRITON_CONFIGS`` (Triton's autotune candidates, default session 53's
H100 leaders ``32:128:2:3,64:64:4:3``; "" = the library's whole set, slower).
Run from the repo root with pdflash installed:
``OUT=$OUT python3 bench/h200/mxfp4_cuda/probe.py [--variants v4,v8,v10]``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

T0 = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
# the library's kernel (one source; pdflash_native._mxfp4gemm links the same file)
SRC = os.path.join(REPO, "cuda", "src", "mxfp4_moe_gemm.cu")
INCLUDE = os.path.join(REPO, "cuda", "include")
BUILD_DIR = "/tmp/mxfp4_cuda"
SO = os.path.join(BUILD_DIR, "mxfp4_gemm.so")
OUT_DIR = os.environ.get("OUT") or "/tmp/out"
ROUNDS = int(os.environ.get("MXC_ROUNDS", "15"))
ITERS = int(os.environ.get("MXC_ITERS", "10"))
TOKENS = [int(t) for t in os.environ.get("MXC_TOKENS", "16,64,256").split(",")]
BUDGET_S = float(os.environ.get("MXC_BUDGET_S", "165"))
CORR_BUDGET_S = float(os.environ.get("MXC_CORR_BUDGET_S", "120"))
# Triton candidates: session 53's H100 leaders (32:128:2:3 at 16 / 64 tokens,
# 64:64:4:3 at 256: 2.14 / 2.02 / 3.19x the roofline); "" = the library's set
TRITON_CONFIGS = os.environ.get("MXC_TRITON_CONFIGS", "32:128:2:3,64:64:4:3")
# the library variants to check and time (names "vN" or indices; "all")
VARIANTS_SPEC = os.environ.get("MXC_VARIANTS", "all")
TOL = 2.0**-7

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0

RESULT: dict[str, Any] = {"kind": "mxfp4_cuda_probe", "tol": TOL}


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def write_json() -> None:
    os.makedirs(OUT_DIR, exist_ok=True)
    RESULT["wall_s"] = time.monotonic() - T0
    with open(os.path.join(OUT_DIR, "mxfp4_cuda.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


# ------------------------------------------------------------------ build
def start_build() -> subprocess.Popen:
    os.makedirs(BUILD_DIR, exist_ok=True)
    nvcc = os.environ.get("NVCC") or "nvcc"
    for cand in (nvcc, "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if cand == nvcc or os.path.exists(cand):
            try:
                subprocess.run([cand, "--version"], capture_output=True, check=True)
                nvcc = cand
                break
            except (OSError, subprocess.CalledProcessError):
                continue
    cmd = [
        nvcc, "-arch=sm_90a", "-DPDFLASH_MXFP4_GEMM_SM90A=1", "-O3", "--shared",
        "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-I", INCLUDE, "-o", SO, SRC,
    ]  # fmt: skip
    RESULT["build_cmd"] = " ".join(cmd)
    log("nvcc: " + " ".join(cmd))
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        print(f"cannot run nvcc ({exc}); set NVCC=/path/to/nvcc", file=sys.stderr)
        RESULT["build_error"] = f"cannot run nvcc: {exc}"
        write_json()
        sys.exit(2)


def finish_build(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        print(out, file=sys.stderr)
        print(f"nvcc failed (rc={proc.returncode})", file=sys.stderr)
        RESULT["build_error"] = out[-20000:]
        write_json()
        sys.exit(2)
    kernels = []
    name = None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            cm = re.search(CFG_RE, name)
            if cm:
                w, mt, nsm, st, mb, pf, kd = cm.groups()
                name = (
                    f"WARPS={w} MT={mt} NSM={nsm} (block_m<={8 * int(nsm)}) STAGES={st} "
                    f"MINB={mb} L2PF={pf} KIND={ {'1': 'wgmma', '2': 'wgmma_px'}.get(kd, 'mma') }"
                )
            target = re.search(r"for '(\w+)'", line)
            if target and target.group(1) != "sm_90a":
                name = None  # another pass (no wgmma there): not what runs
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m and name:
            kernels.append(
                {
                    "kernel": name,
                    "stack": int(m.group(1)),
                    "spill_st": int(m.group(2)),
                    "spill_ld": int(m.group(3)),
                }
            )
        m = re.search(r"Used (\d+) registers", line)
        if m and name and kernels and "regs" not in kernels[-1]:
            kernels[-1]["regs"] = int(m.group(1))
    RESULT["ptxas"] = kernels
    for k in kernels:
        log(
            f"ptxas {k['kernel']}: {k.get('regs')} regs, stack {k['stack']}, "
            f"spill st/ld {k['spill_st']}/{k['spill_ld']}"
        )
    # (ptxas's "Potential Performance Loss": e.g. serialized wgmmas)
    warn = [ln for ln in out.splitlines() if "warning" in ln.lower() or "Performance Loss" in ln]
    RESULT["build_warnings"] = warn
    for w in warn:
        log("nvcc warning: " + w)


# the kernels' Cfg<WARPS, MT, NSM, STAGES, MINB, PF, KIND> in mangled names
CFG_RE = r"CfgILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E"


def check_variant_spec(spec: str) -> None:
    """Exit 2 early for a --variants item that cannot name a variant of the
    source's table (vN / N / vN:... with N in range); the full names are
    matched once the library is built (CudaGemm.select)."""
    if spec.strip() in ("", "all"):
        return
    with open(SRC) as f:
        count = int(re.search(r"kNumVariants = (\d+);", f.read()).group(1))  # type: ignore[union-attr]
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        m = re.fullmatch(r"v?(\d+)(:\S*)?", item)
        if m is None or int(m.group(1)) >= count:
            msg = f"--variants: {item!r} names none of the {count} variants v0..v{count - 1}"
            print(msg, file=sys.stderr)
            RESULT["variants_error"] = msg
            write_json()
            raise SystemExit(2)


def sass_stats(selected: list[dict[str, Any]]) -> None:
    """Static SASS opcode counts per kernel (cuobjdump, if present): how the
    dequant landed on the pipes (LOP3 / SHF / PRMT: integer ALU; IMAD incl.
    IMAD.SHL and HMUL2 / HFMA2: FMA pipe; HMMA: tensor)."""
    import shutil

    exe = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    try:
        out = subprocess.run([exe, "-sass", SO], capture_output=True, text=True, timeout=90).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        RESULT["sass"] = f"cuobjdump unavailable: {exc}"
        return
    keep = ("HMMA", "HGMMA", "LOP3", "SHF", "IMAD", "IMAD.SHL", "IMAD.MOV", "HMUL2", "HFMA2", "PRMT",
            "LDS", "STS", "LDGSTS", "LDG", "BAR", "BRA", "IADD3", "ISETP", "SEL", "LEA")  # fmt: skip
    stats: dict[str, dict[str, int]] = {}
    cur = None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            cm = re.search(CFG_RE, name)
            if cm:
                name = "W{}xMT{}xNSM{}xST{}xMINB{}xPF{}xK{}".format(*cm.groups())
            cur = stats.setdefault(name, {"total": 0})
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and cur is not None:
            op = m.group(1)
            cur["total"] += 1
            base = op.split(".")[0]
            if base in keep:
                cur[base] = cur.get(base, 0) + 1
            two = ".".join(op.split(".")[:2])
            if two in keep and two != base:
                cur[two] = cur.get(two, 0) + 1
    RESULT["sass"] = stats
    # the selected variants' kernels at block_m 16 and 64 (MINB is not in
    # variant_info; the other parameters tell the variants apart)
    wanted = {
        (str(v["warps"]), str(v["mt"]), nsm, str(v["stages"]), str(v["l2_prefetch"]), str(v["kind"]))
        for v in selected
        for nsm in ("2", "8")
    }  # fmt: skip
    for name in sorted(stats):
        f = re.match(r"W(\d+)xMT(\d+)xNSM(\d+)xST(\d+)xMINB\d+xPF(\d+)xK(\d+)$", name)
        if f and f.groups() in wanted:
            s = stats[name]
            log("sass " + name + ": " + " ".join(f"{k}={s[k]}" for k in ("total", *keep) if k in s))


# ------------------------------------------------------------------ kernel wrapper
class CudaGemm:
    def __init__(self, path: str) -> None:
        from pdflash.models.mxfp4_cuda_gemm import Variant

        #: (blocks address, shape) -> (those blocks, their repack_codes copy)
        self.repacked_blocks: dict[tuple[int, tuple[int, ...]], Any] = {}
        lib = ctypes.CDLL(path)
        ll, i32, vp = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p
        lib.mxfp4_moe_gemm.restype = i32
        lib.mxfp4_moe_gemm.argtypes = [
            i32, vp, ll, vp, vp, ll, ll, ll, vp, ll, ll, ll, vp, ll, vp, ll, vp, vp, vp,
            i32, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_float, ctypes.c_float,
            i32, ctypes.c_ulonglong,
        ]  # fmt: skip
        lib.mxfp4_moe_num_variants.restype = i32
        lib.mxfp4_moe_variant_info.restype = i32
        lib.mxfp4_moe_variant_available.restype = i32
        lib.mxfp4_moe_variant_available.argtypes = [i32, i32]
        self.lib = lib
        self.variants = []
        for v in range(lib.mxfp4_moe_num_variants()):
            w, mt, st, bm, pf, kd = (ctypes.c_int() for _ in range(6))
            lib.mxfp4_moe_variant_info(v, *(ctypes.byref(c) for c in (w, mt, st, bm, pf, kd)))
            name = Variant(v, w.value, mt.value, st.value, bm.value, pf.value, kd.value).name
            self.variants.append(
                {"variant": v, "warps": w.value, "mt": mt.value, "stages": st.value, "max_block_m": bm.value,
                 "l2_prefetch": pf.value, "kind": kd.value, "name": name}
            )  # fmt: skip
        self.selected = set(range(len(self.variants)))

    def select(self, spec: str, device_index: int) -> None:
        """Keep the variants named in ``spec`` ("all", or comma-separated
        "vN" / "N" / full names) that run on the device; SystemExit(2) for
        an unknown name."""
        if spec.strip() in ("", "all"):
            chosen = set(range(len(self.variants)))
        else:
            by_name = {v["name"]: v["variant"] for v in self.variants}
            by_name.update({v["name"].split(":")[0]: v["variant"] for v in self.variants})
            by_name.update({str(v["variant"]): v["variant"] for v in self.variants})
            chosen = set()
            for item in (x.strip() for x in spec.split(",") if x.strip()):
                if item not in by_name:
                    msg = f"unknown variant {item!r}; the library's: " + ", ".join(
                        v["name"] for v in self.variants
                    )
                    print(msg, file=sys.stderr)
                    RESULT["variants_error"] = msg
                    write_json()
                    raise SystemExit(2)
                chosen.add(by_name[item])
        for v in sorted(chosen):
            rc = self.lib.mxfp4_moe_variant_available(v, device_index)
            if rc != 0:
                log(f"{self.variants[v]['name']}: does not run on this device (code {rc}); skipped")
                RESULT.setdefault("variants_unavailable", []).append(self.variants[v]["name"])
                chosen.discard(v)
        self.selected = chosen

    def _repacked(self, w):
        from pdflash.models.mxfp4_cuda_gemm import repack_codes

        key = (w.data.data_ptr(), tuple(w.data.shape))
        if key not in self.repacked_blocks:
            # the source kept beside its copy: its address stays taken
            self.repacked_blocks[key] = (w.data, repack_codes(w.data))
        return dataclasses.replace(w, data=self.repacked_blocks[key][1])

    def supports(self, variant: int, block_m: int) -> bool:
        return variant in self.selected and block_m <= self.variants[variant]["max_block_m"]

    def qgemm(self, variant, x, x_rows, tiles, block_m, w, *, act=0, gate_up=(0, 0, 1),
              alpha=1.0, limit=0.0, out=None, x_permuted=False, out_layout=0):  # fmt: skip
        """One grouped GEMM; a kind-2 variant permutes a natural x first
        (``x_permuted``: x is that copy already); ``out_layout`` 1 writes
        the output chunk-permuted (the library's handoff to such a GEMM); a
        kind-3 variant reads the blocks repacked (``repack_codes``, made once
        per blocks tensor and kept: a caller would repack its slab once)."""
        import torch

        from pdflash.models.mxfp4_cuda_gemm import KIND_WGMMA_PX, KIND_WGMMA_RC, chunk_permuted

        if self.variants[variant]["kind"] == KIND_WGMMA_RC:
            w = self._repacked(w)
        n, kb = int(w.data.shape[1]), int(w.data.shape[2])
        if act == 0:
            n_out, (g0, u0, step) = n, (0, 0, 1)
        else:
            g0, u0, step = gate_up
            n_out = -(-(n - max(g0, u0)) // step)
        if out is None:
            width = n_out if out_layout == 0 else -(-n_out // 128) * 128
            out = torch.empty((int(x_rows.numel()), width), dtype=torch.bfloat16, device=x.device)
        slot, start, end = tiles
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and x_rows.dtype == torch.int32
        assert slot.dtype == torch.int32 and slot.is_contiguous() and start.is_contiguous()
        bias = w.bias
        if self.variants[variant]["kind"] == KIND_WGMMA_PX and not x_permuted:
            x = chunk_permuted(x)  # as the library permutes it
        rc = self.lib.mxfp4_moe_gemm(
            variant, x.data_ptr(), x.stride(0), x_rows.data_ptr(),
            w.data.data_ptr(), w.data.stride(0), w.data.stride(1), 4 * w.data.stride(2),
            w.scale.data_ptr(), w.scale.stride(0), w.scale.stride(1), w.scale.stride(2),
            bias.data_ptr() if bias is not None else None, bias.stride(0) if bias is not None else 0,
            out.data_ptr(), out.stride(0), slot.data_ptr(), start.data_ptr(), end.data_ptr(),
            int(slot.numel()), block_m, n, kb * 32, n_out, act, g0, u0, step,
            float(alpha), float(limit), out_layout, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(
                f"mxfp4_moe_gemm(variant {variant}, block_m {block_m}) returned {rc}"
            )
        return out


# ------------------------------------------------------------------ reference / helpers
def routing(g, tokens: int, experts: int, top_k: int, dev):
    import torch

    e = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
    order = torch.argsort(e, stable=True)
    return e[order].to(torch.int32).to(dev), (order // top_k).to(torch.int32).to(dev)


def reference(x, x_rows, key, blocks, scales, bias, act, gate_up, alpha, limit):
    """fp32 ``epilogue(x[x_rows[r]] @ W[key[r]]^T + bias)``, per expert group."""
    import torch

    from pdflash.models.layout import dequantize_mxfp4_torch

    n = blocks.shape[1]
    g0, u0, step = gate_up
    n_out = n if act == 0 else -(-(n - max(g0, u0)) // step)
    out = torch.full((key.numel(), n_out), float("nan"), device=x.device)
    for e in key.unique().tolist():
        rows = (key == e).nonzero().flatten()
        w = dequantize_mxfp4_torch(blocks[e], scales[e], torch.float32)
        h = x[x_rows[rows].long()].float() @ w.T
        if bias is not None:
            h = h + bias[e].float()
        if act == 0:
            out[rows] = h
        else:
            cols = torch.arange(n_out, device=x.device)
            gate = h[:, g0 + cols * step]
            up = h[:, u0 + cols * step]
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
            out[rows] = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return out


def row_error(got, want) -> dict[str, Any]:
    """Per-row relative error (max over rows of max|got-ref| / max|ref| in the
    row, finite entries), the global one, and whether non-finite entries match."""
    import torch

    got = got.float()
    fin = torch.isfinite(want)
    nonfinite_ok = bool(
        torch.equal(torch.isnan(got), torch.isnan(want))
        and torch.equal(
            torch.where(torch.isinf(want), want, 0.0), torch.where(torch.isinf(got), got, 0.0)
        )
    )
    diff = torch.where(fin, (got - want).abs(), 0.0)
    diff = torch.where(fin & ~torch.isfinite(got), float("inf"), diff)
    ref_abs = torch.where(fin, want.abs(), 0.0)
    row_max = ref_abs.amax(dim=1).clamp_min(1e-30)
    per_row = diff.amax(dim=1) / row_max
    return {
        "row_rel": float(per_row.max()) if per_row.numel() else 0.0,
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "global_rel": float(diff.max() / max(1e-30, float(ref_abs.max()))) if diff.numel() else 0.0,
        "nonfinite_match": nonfinite_ok,
        "ref_nonfinite": int((~fin).sum()),
    }


def make_slab(gd, S, N, K, scale_kind, dev, with_bias=True):
    """Random MXFP4 slab on ``dev`` (``gd``: a generator on ``dev``)."""
    import torch

    blocks = torch.randint(0, 256, (S, N, K // 32, 16), generator=gd, dtype=torch.uint8, device=dev)
    if scale_kind == "realistic":
        scales = torch.randint(
            118, 131, (S, N, K // 32), generator=gd, dtype=torch.uint8, device=dev
        )
    elif scale_kind == "wide_fast":  # fast path with D = 0, weights down to 2^-126
        scales = torch.randint(2, 129, (S, N, K // 32), generator=gd, dtype=torch.uint8, device=dev)
    elif scale_kind == "high":  # fast path with D = 112 (spread 60)
        scales = torch.randint(
            180, 241, (S, N, K // 32), generator=gd, dtype=torch.uint8, device=dev
        )
    elif scale_kind == "extreme":  # realistic, plus single extreme bytes in some rows
        scales = torch.randint(
            118, 131, (S, N, K // 32), generator=gd, dtype=torch.uint8, device=dev
        )
        # 0..3: slow path (s < D + 2), subnormal weights; 200 / 240: fast path with D = 72 /
        # 112; 253 / 254: weights overflow to inf (as the fp32 reference's); 255: inf / NaN.
        # (250-252 left out: finite weights near 2^127 whose fp32 sums overflow or not
        # depending on summation order.)
        vals = [0, 1, 2, 3, 200, 240, 253, 254, 255, 0, 240, 255]
        for i, v in enumerate(vals):
            scales[i % S, (97 * i + 3) % N, (5 * i + 1) % (K // 32)] = v
    else:
        raise ValueError(scale_kind)
    bias = (torch.randn(S, N, generator=gd, device=dev) * 0.1).bfloat16() if with_bias else None
    return blocks, scales, bias


# ------------------------------------------------------------------ correctness
def correctness(cg: CudaGemm, k: Any, dev) -> bool:
    import torch

    saved_tune = k.TUNE_MIN_WEIGHTS
    k.TUNE_MIN_WEIGHTS = 1 << 62  # small shapes: Triton's default config only (no tuning)
    g = torch.Generator().manual_seed(1)
    gd = torch.Generator(device=dev).manual_seed(1)
    # slabs: gpt-oss-20b's projections (gate_up 5760 x 2880 for act 1, down 2880 x 2880
    # for act 0; the Triton kernels compiled for the timing shapes serve these too) with
    # fewer experts, plus a small odd one (N 200 / 192, K 96: one 128-k chunk, 3 blocks)
    slabs = {
        ("real", 1): make_slab(gd, 8, 2 * INTER, HIDDEN, "realistic", dev),
        ("real", 0): make_slab(gd, 8, HIDDEN, INTER, "realistic", dev),
        ("wide", 1): make_slab(gd, 4, 2 * INTER, HIDDEN, "wide_fast", dev),
        ("high", 0): make_slab(gd, 4, HIDDEN, INTER, "high", dev),
        ("extreme", 1): make_slab(gd, 4, 2 * INTER, HIDDEN, "extreme", dev),
        ("extreme", 0): make_slab(gd, 4, HIDDEN, INTER, "extreme", dev),
        ("small", 1): make_slab(gd, 4, 200, 96, "realistic", dev),
        ("small", 0): make_slab(gd, 4, 192, 96, "realistic", dev, with_bias=False),
    }
    cases = [
        # name, slab, act, tokens, experts routed over, top_k, block_ms, dead tile mid-list
        ("t1", "real", 1, 1, 8, 4, [16], False),
        ("t1", "real", 0, 1, 8, 4, [16], True),
        ("t5 (1-4 rows/exp)", "real", 1, 5, 8, 4, [16, 32], True),
        ("t13 top1 2 exp", "real", 0, 13, 2, 1, [16, 32], False),
        ("t13 top1 2 exp", "real", 1, 13, 2, 1, [16], True),
        ("t16", "real", 1, 16, 8, 4, [16, 32, 64], True),
        ("t16", "real", 0, 16, 8, 4, [16, 64], False),
        ("t64", "real", 1, 64, 8, 4, [16, 64], False),
        ("t64", "real", 0, 64, 8, 4, [16, 64], True),
        ("t256", "real", 0, 256, 8, 4, [32, 64], True),
        ("t256", "real", 1, 256, 8, 4, [64], False),
        ("t16 scales 2..128", "wide", 1, 16, 4, 4, [16], False),
        ("t16 scales 180..240", "high", 0, 16, 4, 4, [16], False),
        ("t16 extreme scales", "extreme", 1, 16, 4, 2, [16, 64], True),
        ("t16 extreme scales", "extreme", 0, 16, 4, 2, [16], False),
        ("t16 K=96 N=200", "small", 1, 16, 4, 2, [16, 64], True),
        ("t9 K=96 no bias", "small", 0, 9, 4, 2, [16], False),
    ]  # fmt: skip
    records = []
    all_ok = True
    started = time.monotonic()  # after the build: nvcc's time is not the cases'
    for name, slab_name, act, tokens, n_exp, top_k, block_ms, dead in cases:
        if time.monotonic() - started > CORR_BUDGET_S:
            log(f"budget: skipping correctness case {name} act {act} and the rest")
            RESULT.setdefault("correctness_skipped", []).append(f"{name} act{act}")
            all_ok = False
            continue
        blocks, scales, bias = slabs[(slab_name, act)]
        S, N, K = int(blocks.shape[0]), int(blocks.shape[1]), int(blocks.shape[2]) * 32
        skind = {"real": "realistic", "wide": "wide_fast", "high": "high", "extreme": "extreme",
                 "small": "realistic"}[slab_name]  # fmt: skip
        w = k.SlabWeight("mxfp4", blocks, scales, bias)
        x = torch.randn(tokens, K, generator=g).bfloat16().to(dev)
        key, x_rows = routing(g, tokens, n_exp, top_k, dev)
        gate_up = (0, 1, 2) if act else (0, 0, 1)
        want = reference(x, x_rows, key, blocks, scales, bias, act, gate_up, ALPHA, LIMIT)
        want_bf16 = want.bfloat16().float()  # the kernels write bf16
        for bm in block_ms:
            slot, start, end = k.tile_map(key, S, bm, S)  # slot width S (routed over n_exp)
            if dead:  # a dead tile (slot -1, garbage range) in the middle of the list
                mid = slot.numel() // 2
                slot = torch.cat(
                    [slot[:mid], torch.tensor([-1], dtype=torch.int32, device=dev), slot[mid:]]
                )
                start = torch.cat(
                    [start[:mid], torch.tensor([7], dtype=torch.int32, device=dev), start[mid:]]
                )
                end = torch.cat(
                    [end[:mid], torch.tensor([-3], dtype=torch.int32, device=dev), end[mid:]]
                )
            tiles = (slot.contiguous(), start.contiguous(), end.contiguous())
            tri = None
            group: list[dict[str, Any]] = []
            try:
                tri = k.grouped_qgemm(
                    x, x_rows, tiles, bm, w, act=act, gate_up=gate_up, alpha=ALPHA, limit=LIMIT,
                    mxfp4_dot="scaled",
                )  # fmt: skip
                tri_err = row_error(tri, want)
            except Exception as exc:  # report, go on
                tri_err = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            for v in range(len(cg.variants)):
                rec: dict[str, Any] = {
                    "case": name, "block_m": bm, "variant": cg.variants[v]["name"], "rows": int(key.numel()),
                    "act": act, "scales": skind, "K": K, "N": N, "triton_vs_ref": tri_err,
                }  # fmt: skip
                if not cg.supports(v, bm):
                    continue
                try:
                    got = cg.qgemm(
                        v,
                        x,
                        x_rows,
                        tiles,
                        bm,
                        w,
                        act=act,
                        gate_up=gate_up,
                        alpha=ALPHA,
                        limit=LIMIT,
                    )
                    torch.cuda.synchronize()
                    err = row_error(got, want)
                    rec["cuda_vs_ref"] = err
                    rec["cuda_vs_ref_bf16"] = row_error(got, want_bf16)
                    if tri is not None and skind != "extreme":
                        rec["cuda_vs_triton"] = row_error(got, tri.float())
                    ok = err["row_rel"] <= TOL and err["nonfinite_match"]
                    if skind != "extreme" and tri is not None:
                        ok = ok and rec["cuda_vs_triton"]["row_rel"] <= 2 * TOL
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    ok = False
                rec["pass"] = ok
                all_ok &= ok
                records.append(rec)
                group.append(rec)
                if not ok:
                    c = rec.get("cuda_vs_ref", {})
                    t = rec.get("cuda_vs_triton", {})
                    log(
                        f"FAIL {name} act{act} bm={bm} {cg.variants[v]['name']}: cuda-ref "
                        f"row_rel={c.get('row_rel', float('nan')):.2e} max_abs={c.get('max_abs', float('nan')):.2e} "
                        f"nonfinite_ok={c.get('nonfinite_match')} cuda-triton row_rel={t.get('row_rel', float('nan')):.2e}"
                        + (f" ERROR {rec['error']}" if "error" in rec else "")
                    )
            worst = max(
                (r.get("cuda_vs_ref", {}).get("row_rel", float("inf")) for r in group),
                default=float("nan"),
            )
            worst_t = max(
                (r.get("cuda_vs_triton", {}).get("row_rel", 0.0) for r in group),
                default=float("nan"),
            )
            n_ok = sum(r["pass"] for r in group)
            log(
                f"{'PASS' if n_ok == len(group) else 'FAIL'} {name:20s} act{act} bm={bm:2d} rows={int(key.numel()):4d} "
                f"{n_ok}/{len(group)} variants; worst cuda-ref row_rel {worst:.2e}, cuda-triton {worst_t:.2e}; "
                f"triton-ref row_rel {tri_err.get('row_rel', float('nan')):.2e}"
            )
    k.TUNE_MIN_WEIGHTS = saved_tune
    RESULT["correctness"] = records
    RESULT["correctness_pass"] = all_ok
    return all_ok


# ------------------------------------------------------------------ timing
def gptoss_slab(dev):
    import torch

    g = torch.Generator(device=dev).manual_seed(0)

    def mx(n, kk):
        b = torch.randint(
            0, 256, (EXPERTS, n, kk // 32, 16), generator=g, dtype=torch.uint8, device=dev
        )
        s = torch.randint(
            118, 131, (EXPERTS, n, kk // 32), generator=g, dtype=torch.uint8, device=dev
        )
        return b, s

    gu_b, gu_s = mx(2 * INTER, HIDDEN)
    dn_b, dn_s = mx(HIDDEN, INTER)
    return {
        "gate_up_blocks": gu_b, "gate_up_scales": gu_s,
        "gate_up_bias": (torch.randn(EXPERTS, 2 * INTER, generator=g, device=dev) * 0.1).bfloat16(),
        "down_blocks": dn_b, "down_scales": dn_s,
        "down_bias": (torch.randn(EXPERTS, HIDDEN, generator=g, device=dev) * 0.1).bfloat16(),
    }  # fmt: skip


def mlp_reference(x, key, x_rows, slab):
    import torch

    from pdflash.models.layout import dequantize_mxfp4_torch

    out = torch.empty(key.numel(), HIDDEN, device=x.device)
    for e in key.unique().tolist():
        rows = (key == e).nonzero().flatten()
        xe = x[x_rows[rows].long()].float()
        gu = dequantize_mxfp4_torch(
            slab["gate_up_blocks"][e], slab["gate_up_scales"][e], torch.float32
        )
        h = xe @ gu.T + slab["gate_up_bias"][e].float()
        gate, up = h[:, ::2].clamp(max=LIMIT), h[:, 1::2].clamp(-LIMIT, LIMIT)
        a = ((up + 1) * (gate * torch.sigmoid(gate * ALPHA))).bfloat16().float()
        dn = dequantize_mxfp4_torch(slab["down_blocks"][e], slab["down_scales"][e], torch.float32)
        out[rows] = a @ dn.T + slab["down_bias"][e].float()
    return out


def make_runner(fn):
    """A callable running ITERS back-to-back ``fn()`` (a CUDA graph of them if
    capture works, else eager) and its mode."""
    import torch

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(ITERS):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001 (eager fallback, reported)
        log(f"graph capture failed ({type(exc).__name__}: {exc}); eager")
        torch.cuda.synchronize()

        def eager():
            for _ in range(ITERS):
                fn()

        return eager, "eager"


def time_runners(runners: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Per-call µs of each runner, ``rounds`` interleaved rounds (CUDA events)."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for rnd in range(rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:  # rotate the order
            run = runners[name]
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            run()
            en.record()
            en.synchronize()
            times[name].append(st.elapsed_time(en) * 1e3 / ITERS)
    return times


def timing(cg: CudaGemm | None, k: Any, dev, hbm: Any, slab, weights) -> None:
    import torch

    from pdflash.models.compressed_gemm import pick_block_m
    from pdflash.models.mxfp4_cuda_gemm import KIND_WGMMA_PX

    gate_up, down = weights
    per_expert = sum(int(t[0].numel()) * t.element_size() for t in slab.values())
    g = torch.Generator().manual_seed(5)
    rows_out = []
    best: dict[str, Any] = {}
    started = time.monotonic()  # after nvcc and the correctness cases
    for tokens in TOKENS:
        if time.monotonic() - started > BUDGET_S:
            log(f"budget: skipping {tokens} tokens")
            RESULT.setdefault("skipped_tokens", []).append(tokens)
            continue
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().to(dev)
        key, x_rows = routing(g, tokens, EXPERTS, TOP_K, dev)
        n = int(key.numel())
        bm = pick_block_m(n, EXPERTS)
        tiles = k.tile_map(key, EXPERTS, bm, EXPERTS)
        rows = torch.arange(n, dtype=torch.int32, device=dev)
        active = int(key.unique().numel())
        nbytes = per_expert * active
        roof_us = nbytes / (float(hbm) * 1e9) * 1e6 if isinstance(hbm, float) else None
        want = mlp_reference(x, key, x_rows, slab)

        impls: dict[str, Any] = {}

        def triton_mlp():
            h = k.grouped_qgemm(
                x, x_rows, tiles, bm, gate_up, act=k.ACT_GPTOSS, gate_up=(0, 1, 2), alpha=ALPHA,
                limit=LIMIT, mxfp4_dot="scaled",
            )  # fmt: skip
            return k.grouped_qgemm(h, rows, tiles, bm, down, mxfp4_dot="scaled")

        impls["triton"] = triton_mlp
        h_tri = k.grouped_qgemm(
            x, x_rows, tiles, bm, gate_up, act=k.ACT_GPTOSS, gate_up=(0, 1, 2), alpha=ALPHA,
            limit=LIMIT, mxfp4_dot="scaled",
        )  # fmt: skip
        parts: dict[str, Any] = {
            "triton": (
                lambda: k.grouped_qgemm(
                    x,
                    x_rows,
                    tiles,
                    bm,
                    gate_up,
                    act=k.ACT_GPTOSS,
                    gate_up=(0, 1, 2),
                    alpha=ALPHA,
                    limit=LIMIT,
                    mxfp4_dot="scaled",
                ),  # fmt: skip
                lambda: k.grouped_qgemm(h_tri, rows, tiles, bm, down, mxfp4_dot="scaled"),
            )
        }
        if cg is not None:
            for v in range(len(cg.variants)):
                if not cg.supports(v, bm):
                    continue
                # kind 2: the library's handoff (gate_up writes down's x
                # chunk-permuted), so no copy between the two
                handoff = cg.variants[v]["kind"] == KIND_WGMMA_PX
                h_width = -(-INTER // 128) * 128 if handoff else INTER
                h_buf = torch.empty(n, h_width, dtype=torch.bfloat16, device=dev)
                o_buf = torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev)

                def cuda_gu(v=v, h_buf=h_buf, handoff=handoff):
                    cg.qgemm(
                        v,
                        x,
                        x_rows,
                        tiles,
                        bm,
                        gate_up,
                        act=1,
                        gate_up=(0, 1, 2),
                        alpha=ALPHA,
                        limit=LIMIT,
                        out=h_buf,
                        out_layout=int(handoff),
                    )

                def cuda_dn(v=v, h_buf=h_buf, o_buf=o_buf, handoff=handoff):
                    return cg.qgemm(v, h_buf, rows, tiles, bm, down, out=o_buf, x_permuted=handoff)

                def cuda_mlp(gu=cuda_gu, dn=cuda_dn):
                    gu()
                    return dn()

                impls[cg.variants[v]["name"]] = cuda_mlp

                parts[cg.variants[v]["name"]] = (cuda_gu, cuda_dn)
        # warm-up (Triton autotunes here on first use), correctness of every impl
        errs: dict[str, Any] = {}
        for name, fn in list(impls.items()):
            try:
                out = fn()
                out = fn()
                torch.cuda.synchronize()
                errs[name] = row_error(out, want)
            except Exception as exc:
                errs[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"{tokens} tok {name}: {errs[name]['error']}")
                del impls[name]
        # graphs of ITERS back-to-back MLPs, interleaved rounds
        runners: dict[str, Any] = {}
        modes: dict[str, str] = {}
        for name, fn in impls.items():
            runners[name], modes[name] = make_runner(fn)
        times = time_runners(runners, ROUNDS)
        del runners
        # each projection alone (gate_up + SwiGLU; down + bias), same rounds scheme
        part_runners: dict[str, Any] = {}
        for name in times:
            gu_fn, dn_fn = parts[name]
            part_runners[name + "/gate_up"], _ = make_runner(gu_fn)
            part_runners[name + "/down"], _ = make_runner(dn_fn)
        part_times = time_runners(part_runners, max(5, ROUNDS // 2))
        del part_runners
        gu_bytes = active * sum(int(slab[f"gate_up_{s}"][0].numel()) * slab[f"gate_up_{s}"].element_size()
                                for s in ("blocks", "scales", "bias"))  # fmt: skip
        dn_bytes = nbytes - gu_bytes
        bw = float(hbm) * 1e9 if isinstance(hbm, float) else None
        tri_us = statistics.median(times["triton"]) if times.get("triton") else None
        for name, ts in times.items():
            us = statistics.median(ts)
            rec = {
                "tokens": tokens, "impl": name, "block_m": bm, "rows": n, "active_experts": active,
                "bytes": nbytes, "us": us, "us_rounds": ts, "mode": modes[name],
                "triton_us": tri_us, "roofline_us": roof_us,
                "over_roofline": us / roof_us if roof_us else None,
                "triton_over_roofline": tri_us / roof_us if roof_us and tri_us else None,
                "vs_ref": errs.get(name),
                "gate_up_us": statistics.median(part_times[name + "/gate_up"]),
                "down_us": statistics.median(part_times[name + "/down"]),
                "gate_up_roofline_us": gu_bytes / bw * 1e6 if bw else None,
                "down_roofline_us": dn_bytes / bw * 1e6 if bw else None,
            }  # fmt: skip
            rows_out.append(rec)
        cuda_recs = [
            r for r in rows_out
            if r["tokens"] == tokens and r["impl"] != "triton"
            and r["vs_ref"] and r["vs_ref"].get("row_rel", 1) <= 4 * TOL
        ]  # fmt: skip
        if cuda_recs:
            b = min(cuda_recs, key=lambda r: r["us"])
            best[str(tokens)] = {
                "impl": b["impl"], "cuda_us": b["us"], "triton_us": tri_us, "roofline_us": roof_us,
                "cuda_over_roofline": b["over_roofline"],
                "triton_over_roofline": tri_us / roof_us if roof_us and tri_us else None,
            }  # fmt: skip
        log(f"{tokens} tok done (block_m {bm}, {active} experts, {nbytes / 1e6:.1f} MB)")
        torch.cuda.synchronize()
    RESULT["timing"] = rows_out
    RESULT["best"] = best
    try:
        RESULT["triton_autotune"] = {
            str(kk): str(v) for kk, v in k._grouped_qgemm_kernel.cache.items()
        }
    except Exception:  # noqa: BLE001 (informational only)
        pass


def print_table() -> None:
    rows = RESULT.get("timing", [])
    if not rows:
        return
    print()
    print(
        "(impl = triton or vVARIANT:WARPSw MTmt STAGESst[pfL2][wg = wgmma]; cuda_us = that impl's per-MLP us; "
        "gu / dn = gate_up / down alone, (x roofline))"
    )
    print(f"{'tokens':>6} {'impl':16s} {'bm':>3} {'cuda_us':>9} {'triton_us':>9} {'roof_us':>8} "
          f"{'cuda/roof':>9} {'tri/roof':>8} {'row_rel_err':>11} {'gu_us(x)':>13} {'dn_us(x)':>13} mode")  # fmt: skip
    for r in rows:
        roof = r["roofline_us"]
        err = (r.get("vs_ref") or {}).get("row_rel")
        print(
            f"{r['tokens']:6d} {r['impl']:16s} {r['block_m']:3d} {r['us']:9.1f} "
            f"{(r['triton_us'] or float('nan')):9.1f} {(roof or float('nan')):8.1f} "
            f"{(r['over_roofline'] or float('nan')):9.2f} {(r['triton_over_roofline'] or float('nan')):8.2f} "
            f"{(err if err is not None else float('nan')):11.2e} "
            f"{r['gate_up_us']:7.1f}({r['gate_up_us'] / (r['gate_up_roofline_us'] or float('nan')):4.2f}) "
            f"{r['down_us']:7.1f}({r['down_us'] / (r['down_roofline_us'] or float('nan')):4.2f}) {r['mode']}"
        )
    print()
    for t, b in RESULT.get("best", {}).items():
        print(
            f"best at {t:>3} tokens: {b['impl']} {b['cuda_us']:.1f} us = {b['cuda_over_roofline'] or float('nan'):.2f}x roofline; "
            f"triton {b['triton_us'] or float('nan'):.1f} us = {b['triton_over_roofline'] or float('nan'):.2f}x"
        )


def print_summary() -> None:
    recs = RESULT.get("correctness", [])
    bad = [r for r in recs if not r["pass"]]
    print(f"correctness: {len(recs) - len(bad)}/{len(recs)} (case, block_m, variant) checks pass"
          f" (tol row_rel <= {TOL:.4g}; skipped: {RESULT.get('correctness_skipped', [])})")  # fmt: skip
    for r in bad[:12]:
        c = r.get("cuda_vs_ref", {})
        print(f"  FAIL {r['case']} act{r['act']} bm={r['block_m']} {r['variant']}: row_rel={c.get('row_rel')} "
              f"nonfinite_ok={c.get('nonfinite_match')} {r.get('error', '')}")  # fmt: skip
    for key in ("correctness_error", "timing_error"):
        if key in RESULT:
            print(f"{key}: {RESULT[key][-1500:]}")
    base = RESULT.get("triton_baseline_before_cuda", {})
    if base:
        print(
            "triton alone (before any CUDA-kernel launch): "
            + ", ".join(
                f"{t} tok {b['us']:.1f} us ({(b['over_roofline'] or float('nan')):.2f}x)"
                for t, b in base.items()
            )
        )
    print(f"HBM copy bandwidth {RESULT.get('hbm_gbps')} GB/s on {RESULT.get('device')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variants",
        default=VARIANTS_SPEC,
        help="library variants to check and time: 'all' or comma-separated names "
        "(vN, N or the full name, e.g. v4,v8,v10); default $MXC_VARIANTS or all",
    )
    args = ap.parse_args(argv)
    check_variant_spec(args.variants)  # before minutes of build and autotune
    build = start_build()
    if TRITON_CONFIGS and "PDFLASH_FUSED_CONFIGS" not in os.environ:
        os.environ["PDFLASH_FUSED_CONFIGS"] = TRITON_CONFIGS  # read when the kernels import
    RESULT["triton_configs"] = os.environ.get("PDFLASH_FUSED_CONFIGS", "library default")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    RESULT["device"] = props.name
    RESULT["capability"] = list(torch.cuda.get_device_capability(dev))
    RESULT["torch"] = torch.__version__
    log(f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
    from pdflash.engine.roofline import measure_hbm_gbps
    from pdflash.models import fused_moe_triton as k

    try:
        import triton

        RESULT["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    hbm = measure_hbm_gbps(dev)
    RESULT["hbm_gbps"] = hbm
    log(f"HBM copy bandwidth: {hbm}")
    write_json()
    slab = gptoss_slab(dev)
    weights = tuple(
        k.SlabWeight("mxfp4", slab[f"{n}_blocks"], slab[f"{n}_scales"], slab[f"{n}_bias"])
        for n in ("gate_up", "down")
    )
    # Triton autotune for the timing shapes while nvcc builds
    from pdflash.models.compressed_gemm import pick_block_m

    g = torch.Generator().manual_seed(9)
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().to(dev)
        key, x_rows = routing(g, tokens, EXPERTS, TOP_K, dev)
        bm = pick_block_m(int(key.numel()), EXPERTS)
        tiles = k.tile_map(key, EXPERTS, bm, EXPERTS)
        rows = torch.arange(key.numel(), dtype=torch.int32, device=dev)
        h = k.grouped_qgemm(x, x_rows, tiles, bm, weights[0], act=k.ACT_GPTOSS, gate_up=(0, 1, 2),
                            alpha=ALPHA, limit=LIMIT, mxfp4_dot="scaled")  # fmt: skip
        k.grouped_qgemm(h, rows, tiles, bm, weights[1], mxfp4_dot="scaled")
        torch.cuda.synchronize()

        def tri(x=x, x_rows=x_rows, tiles=tiles, bm=bm, rows=rows):
            hh = k.grouped_qgemm(x, x_rows, tiles, bm, weights[0], act=k.ACT_GPTOSS, gate_up=(0, 1, 2),
                                 alpha=ALPHA, limit=LIMIT, mxfp4_dot="scaled")  # fmt: skip
            return k.grouped_qgemm(hh, rows, tiles, bm, weights[1], mxfp4_dot="scaled")

        run, mode = make_runner(tri)
        us = statistics.median(time_runners({"triton": run}, 5)["triton"])
        active = int(key.unique().numel())
        per_expert = sum(int(t[0].numel()) * t.element_size() for t in slab.values())
        roof = per_expert * active / (float(hbm) * 1e9) * 1e6 if isinstance(hbm, float) else None
        RESULT.setdefault("triton_baseline_before_cuda", {})[str(tokens)] = {
            "us": us, "mode": mode, "block_m": bm, "active_experts": active, "roofline_us": roof,
            "over_roofline": us / roof if roof else None,
        }  # fmt: skip
        del run
        log(
            f"triton warm-up / autotune at {tokens} tokens (block_m {bm}) done: {us:.1f} us"
            + (f" = {us / roof:.2f}x roofline" if roof else "")
        )
    finish_build(build)
    log("nvcc done")
    cg = CudaGemm(SO)
    RESULT["variants"] = cg.variants
    cg.select(args.variants, torch.cuda.current_device())
    RESULT["selected_variants"] = [cg.variants[v]["name"] for v in sorted(cg.selected)]
    log("variants: " + ", ".join(RESULT["selected_variants"]))
    sass_stats([cg.variants[v] for v in sorted(cg.selected)])
    ok = False
    try:
        ok = correctness(cg, k, dev)
    except Exception:
        RESULT["correctness_error"] = traceback.format_exc()
        log("correctness stage crashed:\n" + RESULT["correctness_error"])
    write_json()
    skipped = len(RESULT.get("correctness_skipped", []))
    verdict = "ALL PASS" if ok else "FAILURES (see above)"
    failed = any(not r["pass"] for r in RESULT.get("correctness", []))
    if skipped and "correctness_error" not in RESULT and not failed:
        verdict = f"INCOMPLETE: every case run passed, {skipped} skipped by MXC_CORR_BUDGET_S"
    log(f"correctness: {verdict}")
    try:
        timing(cg, k, dev, hbm, slab, weights)
    except Exception:
        RESULT["timing_error"] = traceback.format_exc()
        log("timing stage crashed:\n" + RESULT["timing_error"])
    write_json()
    print_table()
    print_summary()
    log(f"wrote {os.path.join(OUT_DIR, 'mxfp4_cuda.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
