"""What a panel of ``alignkit plot`` shows on its axes (``plot.py`` draws the figure): its title, its y-range and the
moving average of a long series. No matplotlib here, no torch."""

from __future__ import annotations

from collections.abc import Sequence

#: a panel's y-axis spans at least this fraction of its values' magnitude (:func:`honest_ylim`)
MIN_SPAN = 0.05
#: a panel title longer than this many characters goes one name a line (:func:`panel_title`)
TITLE_CHARS = 40


def panel_title(names: Sequence[str]) -> str:
    """The names of a panel's series joined by " = ", a line each once they would pass the panel's width."""
    one = " = ".join(names)
    return one if len(one) <= TITLE_CHARS else "\n= ".join(names)


def honest_ylim(lo: float, hi: float, ax_lo: float, ax_hi: float) -> tuple[float, float]:
    """The y-range of values in [``lo``, ``hi``] (autoscaled to [``ax_lo``, ``ax_hi``]), widened about its middle
    to at least :data:`MIN_SPAN` of their magnitude: a dip from 1.0 to 0.994 is a dip of 0.6%, not a cliff."""
    span = MIN_SPAN * max(abs(lo), abs(hi))
    if ax_hi - ax_lo >= span:
        return ax_lo, ax_hi
    mid = (lo + hi) / 2
    return mid - span / 2, mid + span / 2


def window(n: int) -> int:
    """The moving average's points for a series of ``n``: odd, so it is centred."""
    return max(3, n // 40) | 1  # odd: centred


def moving_average(values: Sequence[float], k: int) -> list[float]:
    """Centred mean over ``k`` points (fewer, still centred, near the ends) of the finite values only;
    NaN where the value itself is NaN, so gaps stay visible."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    ok = np.isfinite(v)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(len(v))
    half = np.minimum(k // 2, np.minimum(idx, len(v) - 1 - idx))  # symmetric near the ends too: no lag, no bias
    lo, hi = idx - half, idx + half + 1
    n = counts[hi] - counts[lo]
    out = np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)
    out[~ok] = np.nan
    return out.tolist()
