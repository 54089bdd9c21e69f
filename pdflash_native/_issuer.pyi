from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

BAND_NAMES: tuple[str, str, str]
STATE_QUEUED: Final[int]
STATE_RUNNING: Final[int]
STATE_DONE: Final[int]
STATE_FAILED: Final[int]
STATE_CANCELLED: Final[int]
LOG_SUBMIT: Final[int]
LOG_PROMOTE: Final[int]
LOG_CANCEL: Final[int]
LOG_START: Final[int]
LOG_END: Final[int]
LOG_FINISH: Final[int]
LOG_DTYPE: np.dtype[np.void]

class CopyFailedError(RuntimeError):
    ticket: int
    def __init__(self, ticket: int, message: str) -> None: ...

class CopyCancelledError(RuntimeError):
    ticket: int
    def __init__(self, ticket: int, message: str) -> None: ...

def cuda_device_count() -> int: ...
def built_with_cuda() -> bool: ...
def live_counts() -> dict[str, int]: ...

@disjoint_base
class PinnedBuffer:
    def __init__(
        self,
        nbytes: int,
        cuda: bool,
        device: int = 0,
        release: Callable[[int, int], object] | None = None,
    ) -> None: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def cuda(self) -> bool: ...
    def free(self) -> None: ...

@disjoint_base
class NativeIssuer:
    use_cuda: bool
    device: int
    def __init__(
        self,
        use_cuda: bool,
        device: int = 0,
        chunk_bytes: int = ...,
        window_bytes: int = ...,
        max_inflight_chunks: int = 32,
        emulated_link_gbps: float = 0.0,
        debug_log: bool = False,
        issue_lead_s: float = 0.0,
    ) -> None: ...
    @property
    def backend(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def submit(
        self,
        src: npt.NDArray[np.int64],
        dst: npt.NDArray[np.int64],
        nbytes: int | npt.NDArray[np.int64],
        keys: npt.NDArray[np.int64],
        band: int,
    ) -> npt.NDArray[np.int64]: ...
    def states(self, tickets: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]: ...
    def wait(self, tickets: npt.NDArray[np.int64], timeout_s: float = -1.0) -> None: ...
    def stream_wait(
        self, tickets: npt.NDArray[np.int64], stream: int, timeout_s: float = -1.0
    ) -> None: ...
    def cancel(self, band: int = -1) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def debug_log(self) -> npt.NDArray[np.void]: ...
    def note_pinned_region(self, ptr: int, nbytes: int) -> None: ...
    def release_region(self, ptr: int, nbytes: int) -> int: ...
    def register_host(self, ptr: int, nbytes: int) -> None: ...
    def unregister_host(self, ptr: int) -> None: ...
    def test_hold_link(self, hold: bool) -> bool: ...
    def test_inject_failures(self, count: int, text: str) -> bool: ...
    def close(self) -> None: ...
