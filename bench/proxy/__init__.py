"""A trained proxy MoE and its DFlash drafter, built from this machine's own
Python sources, so routing and acceptance can be measured instead of assumed.

Modules: :mod:`.corpus` (sources, dedup, held-out split, manifest),
:mod:`.tokenizer` (byte-level BPE with reserved ids), :mod:`.presets`,
:mod:`.target` (the qwen3_moe target trainer), :mod:`.routing_stats`,
:mod:`.drafter` (the DFlash drafter trainer), :mod:`.decode` (a minimal
speculative decoding loop and acceptance evaluation), :mod:`.export` (the
routing/acceptance trace, in the package's :mod:`pdflash.traces` format) and
:mod:`.cli`
(``pdflash-bench proxy train|draft|eval|trace``).

Everything here is importable without a GPU; heavy imports (torch,
transformers, tokenizers) happen inside functions or in modules the CLI loads
lazily.
"""
