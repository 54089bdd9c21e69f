"""The issuer's contract in pdflash.protocols matches the native module: the
ticket-state codes and the copy errors are the ones _issuer reports and raises."""

from __future__ import annotations

import pytest

from pdflash import h2d, protocols
from pdflash.protocols import TicketState
from pdflash_native import _issuer

pytestmark = pytest.mark.native


def test_ticket_states_are_the_native_codes() -> None:
    native = {
        "QUEUED": _issuer.STATE_QUEUED,
        "RUNNING": _issuer.STATE_RUNNING,
        "DONE": _issuer.STATE_DONE,
        "FAILED": _issuer.STATE_FAILED,
        "CANCELLED": _issuer.STATE_CANCELLED,
    }
    assert {s.name: int(s) for s in TicketState} == native
    assert [h2d.STATE_QUEUED, h2d.STATE_DONE] == [TicketState.QUEUED, TicketState.DONE]


def test_copy_errors_are_the_native_classes() -> None:
    assert protocols.CopyFailedError is _issuer.CopyFailedError is h2d.CopyFailedError
    assert protocols.CopyCancelledError is _issuer.CopyCancelledError is h2d.CopyCancelledError
