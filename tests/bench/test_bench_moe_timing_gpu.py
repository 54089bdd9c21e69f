"""The moe bench's all-hit timing (:func:`pdflash.bench.suites.moe._timed`) on
a CUDA device: the device-only time is measured with the calls queued, and a
host-bound call is told apart from a device-bound one."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_timed_separates_host_and_device_time() -> None:
    from pdflash.bench.suites.moe import _host_bound, _timed

    device = torch.device("cuda")
    small = torch.ones(16, device=device)

    def many_tiny() -> None:  # 30 tiny launches and 300 µs of host work: host-bound
        for _ in range(30):
            small.add_(1)
        end = time.perf_counter() + 300e-6
        while time.perf_counter() < end:
            pass

    t = _timed(many_tiny, 10, device)
    assert isinstance(t["device_us"], float) and t["device_iters"] == 10, t
    assert t["host_us"] > t["device_us"] and _host_bound(t) is True
    # back-to-back events see the host's pace here, not the device's
    assert t["us"] > 1.5 * t["device_us"] and t["host_us"] >= 300
    # a call said to launch many kernels is queued fewer times
    t = _timed(many_tiny, 10, device, launches_per_call=200)
    assert t["device_iters"] == 3 and isinstance(t["device_us"], float), t

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def big() -> None:  # one long kernel: device-bound
        torch.mm(a, a)

    t = _timed(big, 10, device)
    assert isinstance(t["device_us"], float), t
    assert _host_bound(t) is False
    assert 0.8 < t["us"] / t["device_us"] < 1.25
