"""Example budgets that scale with the loaded hypothesis profile.

``scaled(n)`` is ``n`` under the ``ci`` profile and ``n * THOROUGH_FACTOR``
under ``thorough`` (in general ``n * max_examples / CI_EXAMPLES`` of the
loaded profile), so a test that sets its own ``max_examples`` still follows
the profile (see ``tests/conftest.py``).
"""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 60
THOROUGH_FACTOR = 30


def scaled(n: int) -> int:
    """``n`` examples under ``ci``, proportionally more under a larger profile."""
    return max(1, n * settings.default.max_examples // CI_EXAMPLES)
