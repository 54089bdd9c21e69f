"""Counting what named methods do on :mod:`pdflash.bench.eager_host`'s verify
step: the harness the CPU counting scripts under ``bench/results/cpu/``
share (what they count is theirs).

An :class:`EagerCount` wraps methods so that :attr:`EagerCount.inside` names
the innermost wrapped method running (``Class.method``), counts the MoE layer
calls (``OffloadedMoE._forward_grouped``) and switches counting on at
eager_host's first timer patch: from the first timed step on (the warm-up and
timed verify steps), not the prompt's prefill, which runs before.
:meth:`EagerCount.run` runs eager_host with one counting step; a per-layer
figure is a total over :attr:`EagerCount.moe_layers`.

The wrappers live in this module: a script that profiles pdflash's own calls
(``sys.setprofile``) tells them apart by :data:`HARNESS_FILE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

#: this module's source file: the frames of its wrappers
HARNESS_FILE = __file__


class EagerCount:
    """Which wrapped method runs, and how many MoE layers ran, while counting
    (module doc)."""

    def __init__(self) -> None:
        self.on = False
        self.stack: list[str] = []
        self.layers = 0

    @property
    def inside(self) -> str | None:
        """The innermost wrapped method running while counting is on, else None."""
        return self.stack[-1] if self.on and self.stack else None

    @property
    def moe_layers(self) -> int:
        """The MoE layer calls counted, at least 1 (a per-layer divisor)."""
        return max(self.layers, 1)

    def wrap(
        self,
        cls: Any,
        name: str,
        outermost: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """Replace ``cls.name`` by a wrapper that keeps it on :attr:`stack`
        while it runs (counting on or off); ``outermost``: a context entered
        around the call when no other wrapped method is running."""
        real = getattr(cls, name)
        label = f"{cls.__name__}.{name}"
        stack = self.stack

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            stack.append(label)
            context = outermost() if outermost is not None and len(stack) == 1 else None
            try:
                if context is None:
                    return real(obj, *args, **kwargs)
                with context:
                    return real(obj, *args, **kwargs)
            finally:
                stack.pop()

        wrapper.__name__ = name
        setattr(cls, name, wrapper)

    def run(self, eager_host_argv: Sequence[str]) -> int:
        """Count the MoE layers, switch counting on at the first timer patch
        and run eager_host on ``eager_host_argv`` with one counting step."""
        from pdflash.bench import eager_host

        from pdflash.models.offload import OffloadedMoE

        real_layer = OffloadedMoE._forward_grouped

        def layer(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.layers += 1
            return real_layer(obj, *args, **kwargs)

        OffloadedMoE._forward_grouped = layer  # type: ignore[method-assign,assignment]
        patch = eager_host.ExclusiveTimer.patch

        def start_counting(timer: Any, *args: Any, **kwargs: Any) -> Any:
            self.on = True
            return patch(timer, *args, **kwargs)

        eager_host.ExclusiveTimer.patch = start_counting  # type: ignore[method-assign,assignment]
        return eager_host.main([*eager_host_argv, "--count-steps", "1"])
