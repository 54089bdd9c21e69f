"""Pure-Python reference of the host-to-stream signals
(``pdflash_native._hostsignal``, ``cuda/include/pdflash/host_signal.h``).

* :func:`signal_value`, :func:`signal_state`, :func:`next_seq`: the flag
  word's encoding (``(seq << 1) | failed``, seq in ``[1, 2^31)``);
* :func:`wait_signal`: the polling loop the device kernel and the host
  stand-in both run (same order: load, decide, check the deadline, pause);
* :class:`SignalRingRef`: the ring's tickets, the host's store, the wait's
  ack and sticky error writes (the native ``wait_host`` with its CPU clock;
  compared op by op in ``tests/hybrid/test_host_signal.py``).

Slow on purpose; never used at run time.
"""

from __future__ import annotations

from collections.abc import Callable

SEQ_MASK = 0x7FFFFFFF
PENDING, DONE, FAILED = 0, 1, 2
OUTCOME_NONE, OUTCOME_DONE, OUTCOME_FAILED, OUTCOME_TIMED_OUT = 0, 1, 2, 3


def signal_value(seq: int, failed: bool) -> int:
    return ((seq & SEQ_MASK) << 1) | int(bool(failed))


def signal_state(value: int, seq: int) -> int:
    if (value >> 1) != (seq & SEQ_MASK):
        return PENDING
    return FAILED if value & 1 else DONE


def next_seq(seq: int) -> int:
    n = (seq + 1) & SEQ_MASK
    return 1 if n == 0 else n


def wait_signal(
    load: Callable[[], int],
    now_ns: Callable[[], int],
    pause: Callable[[], None],
    seq: int,
    timeout_ns: int,
) -> int:
    """Poll until the flag carries ``seq`` or ``timeout_ns`` passed: an
    ``OUTCOME_*`` (a flag found with the deadline counts)."""
    t0 = now_ns()
    while True:
        state = signal_state(load(), seq)
        if state == DONE:
            return OUTCOME_DONE
        if state == FAILED:
            return OUTCOME_FAILED
        if now_ns() - t0 >= timeout_ns:
            return OUTCOME_TIMED_OUT
        pause()


class SignalRingRef:
    """The ring of ``capacity`` slots (flags, acks, the sticky error words)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.flags = [0] * capacity
        self.acks = [0] * capacity
        self.error_code = OUTCOME_NONE
        self.error_seq = 0
        self.last_seq = [0] * capacity
        self.next_seq = 1
        self.next_slot = 0

    def acquire(self) -> tuple[int, int]:
        """The next ``(slot, seq)``; RuntimeError when the sticky error is set
        or the slot's previous wait has not acknowledged (the native ring
        waits a bounded time first; with that bound 0 they agree)."""
        if self.error_code != OUTCOME_NONE:
            raise RuntimeError("the ring is unusable")
        slot = self.next_slot
        prev = self.last_seq[slot]
        if prev != 0 and self.acks[slot] != prev:
            raise RuntimeError(f"slot {slot}'s previous wait has not run")
        seq = self.next_seq
        self.last_seq[slot] = seq
        self.next_seq = next_seq(seq)
        self.next_slot = (slot + 1) % self.capacity
        return slot, seq

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} out of range")

    def signal(self, slot: int, seq: int, failed: bool) -> None:
        self._check(slot)
        self.flags[slot] = signal_value(seq, failed)

    def unmap(self) -> None:
        """The native ring moves its words out of page-locked memory: no
        word changes (nothing to model but that)."""

    def wait(self, slot: int, seq: int, timeout_ns: int, clock: Callable[[], int]) -> int:
        """The wait's loop on ``clock``, then its ack and error writes."""
        self._check(slot)
        outcome = wait_signal(lambda: self.flags[slot], clock, lambda: None, seq, timeout_ns)
        if outcome != OUTCOME_DONE and self.error_code == OUTCOME_NONE:
            self.error_seq = seq
            self.error_code = outcome
        self.acks[slot] = seq
        return outcome
