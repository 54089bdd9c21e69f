"""What the native host kernel's tests share: the ISAs this CPU runs
(``pdflash.hybrid.native``'s ``scalar``, ``avx512_bf16``, ``amx_bf16``), the
marks that skip a test where one is missing, and gpt-oss's activation
constants the kernels are built with."""

from __future__ import annotations

import pytest

from pdflash.hybrid.native import cpu_has_amx_bf16, cpu_has_avx512_bf16

ALPHA, LIMIT = 1.702, 7.0
HAS_AVX = cpu_has_avx512_bf16()
HAS_AMX = HAS_AVX and cpu_has_amx_bf16()
#: every ISA this CPU runs, the portable scalar loops first
ISAS = ["scalar", *(["avx512_bf16"] if HAS_AVX else []), *(["amx_bf16"] if HAS_AMX else [])]
needs_avx = pytest.mark.skipif(not HAS_AVX, reason="this CPU has no AVX-512 BF16")
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or OS) offers no AMX BF16")
