"""The package foundation: import guard, stubs, lint and type gates."""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pdflash
import pdflash_native
from pdflash import _native

REPO = Path(__file__).resolve().parents[2]


def test_every_native_module_loads_compiled() -> None:
    modules = _native.load_all()
    assert set(modules) == set(_native.NATIVE_MODULES)
    for name, module in modules.items():
        # a compiled extension, not a .py fallback
        assert Path(module.__file__ or "").suffix in {".so", ".pyd"}, name


def test_missing_native_module_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "NATIVE_MODULES", (*_native.NATIVE_MODULES, "_not_built"))
    with pytest.raises(_native.NativeExtensionError, match=r"pdflash_native\._not_built"):
        _native.load_all()


def test_import_pdflash_fails_loudly_when_a_module_is_broken(tmp_path: Path) -> None:
    # A fresh interpreter where one native module's import raises: importing
    # pdflash must raise NativeExtensionError naming it, not fall back.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'pdflash_native._build_info':\n"
        "            raise ImportError('simulated broken build')\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import pdflash\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
        "    raise SystemExit(0)\n"
        "raise SystemExit('pdflash imported without its native module')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert "NativeExtensionError" in out.stdout
    assert "pdflash_native._build_info" in out.stdout


def test_build_info_reports_cuda_flag() -> None:
    info = importlib.import_module("pdflash_native._build_info").summary()
    assert isinstance(info["cuda_compiled"], bool)
    # nvcc on PATH at build time means the CUDA backend must have been built
    # (PDFLASH_CUDA=AUTO), unless the builder turned it off explicitly.
    import os

    if shutil.which("nvcc") and os.environ.get("PDFLASH_CUDA", "AUTO") != "OFF":
        assert info["cuda_compiled"] is True
    # the CUDA MXFP4 GEMM builds exactly when CUDA does (default sm_90)
    assert importlib.import_module("pdflash_native._mxfp4gemm").BUILT is info["cuda_compiled"]


@pytest.mark.slow
def test_cpu_only_build_compiles_every_native_module(tmp_path: Path) -> None:
    """PDFLASH_CUDA=OFF must build a complete wheel (host issuer backend only)."""
    pytest.importorskip("scikit_build_core")
    pytest.importorskip("Cython")
    import os
    import zipfile

    out = tmp_path / "wheel"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "--config-settings=build-dir=" + str(tmp_path / "build"),
            "-w",
            str(out),
            str(REPO),
        ],
        env={**os.environ, "PDFLASH_CUDA": "OFF"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = zipfile.ZipFile(next(out.glob("pdflash-*.whl"))).namelist()
    for name in _native.NATIVE_MODULES:
        assert any(n.startswith(f"pdflash_native/{name}.") and n.endswith(".so") for n in names), (
            name
        )
    cmake_cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    assert "PDFLASH_CUDA:STRING=OFF" in cmake_cache
    # the CUDA MXFP4 GEMM's module imports there and refuses to launch, clearly
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(next(out.glob("pdflash-*.whl"))).extractall(unpacked)
    probe = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "import sys; sys.path.insert(0, '.'); import pdflash_native._mxfp4gemm as m; "
            "assert m.BUILT is False and m.num_variants() == 0 and m.WGMMA_BUILT is False\n"
            "assert m.variant_available(10, 0) == m.NOT_BUILT\n"
            "try:\n m.launch(*([0] * 28), 1.0, 0.0, 0, 0)\n"
            "except RuntimeError as e:\n print(e)",
        ],
        cwd=unpacked,
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    assert "built without the CUDA MXFP4 GEMM" in probe.stdout
    # the compile lines the generator wrote: no flag that lets the compiler
    # emit POPCNT (or newer) unconditionally (the dispatch is at run time)
    flag_files = [
        f for f in (tmp_path / "build").rglob("*") if f.name in {"flags.make", "build.ninja"}
    ]
    assert flag_files
    for f in flag_files:
        for flag in _CPU_FEATURE_FLAGS:
            assert flag not in f.read_text(), (f, flag)


def _assert_wheel_carries_code_only(names: list[str]) -> None:
    """The benchmark harness ships as pdflash.bench, but not its recorded
    results or GPU session scripts, and the serving package holds no harness."""
    assert "pdflash/bench/cli.py" in names
    assert "pdflash/bench/engine_run.py" in names
    assert "pdflash/bench/workload.py" in names
    assert not [n for n in names if n.startswith(("pdflash/bench/results/", "pdflash/bench/h200/"))]
    bench_suffixes = {Path(n).suffix for n in names if n.startswith("pdflash/bench/")}
    assert bench_suffixes == {".py"}, bench_suffixes
    assert "pdflash/engine/bench_run.py" not in names
    assert "pdflash/engine/workload.py" not in names
    assert "pdflash/engine/realtext.py" not in names
    # the recorded results are still in the repository (only the wheel drops them)
    assert any((REPO / "bench" / "results").rglob("*.json"))


# Compiler flags that would make the wheel need a CPU feature (POPCNT and
# later) that some x86-64 CPUs lack.
_CPU_FEATURE_FLAGS = ("-mpopcnt", "-march=", "-msse4", "-mavx", "-mbmi", "/arch:")


def test_build_files_require_no_cpu_feature() -> None:
    """POPCNT is picked at run time (pdflash_native/_bitops.pxd); no CMake
    file may compile a module for it (a SIGILL on CPUs without it)."""
    cmake_files = [REPO / "CMakeLists.txt", *REPO.glob("cmake/*.cmake")]
    cmake_files += [*REPO.glob("pdflash_native/CMakeLists.txt"), *REPO.glob("cuda/CMakeLists.txt")]
    assert len(cmake_files) >= 3
    for f in cmake_files:
        text = f.read_text()
        for flag in _CPU_FEATURE_FLAGS:
            assert flag not in text, (f, flag)


def test_popcount_dispatch_agrees_across_modules() -> None:
    """Every module with bitset kernels detects POPCNT the same way (one
    shared _bitops.pxd), and the detection matches the CPU where Linux says."""
    flags = {
        name: _native.load_native(name).uses_popcnt_instruction()
        for name in ("_deficit", "_routeahead")
    }
    assert len(set(flags.values())) == 1, flags
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and platform.machine() in {"x86_64", "AMD64"}:
        assert flags["_deficit"] == (" popcnt" in cpuinfo.read_text())


def test_py_typed_shipped() -> None:
    assert (Path(pdflash.__file__).parent / "py.typed").is_file()
    assert (Path(pdflash_native.__file__).parent / "py.typed").is_file()


def test_stubs_match_compiled_modules(tmp_path: Path) -> None:
    """pandas-style stubtest gate: the hand-written .pyi files must describe
    the compiled modules exactly."""
    pytest.importorskip("mypy")
    modules = [f"pdflash_native.{name}" for name in _native.NATIVE_MODULES]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "--allowlist",
            str(Path(__file__).with_name("stubtest_allowlist.txt")),
            *modules,
        ],
        cwd=tmp_path,  # never pick up the source tree instead of the install
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (it is in the [test] extra)")
    proc = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_and_ci_run_the_same_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    marker = "# test-command"
    cmd = next(line for line in ci.splitlines() if line.rstrip().endswith(marker))
    cmd = cmd.replace(marker, "").strip()
    assert cmd in readme
