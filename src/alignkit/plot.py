"""Pictures of runs: every numeric metric of ``OUTPUT_DIR/metrics.jsonl`` against step, one panel each.

``alignkit plot RUN_DIR [RUN_DIR ...]`` and the end of every run (``logging.plot``) call
:func:`plot_runs`. Several runs are overlaid, one colour per run, named by their folders.

Reading rules (:func:`read_metrics`): ``time``, ``step`` and ``epoch`` are not panels; a ``null``
value (a non-finite number, see :meth:`alignkit.logging.RunLogger.log_metrics`) is a gap in the
line, marked with an ``x`` on the step axis; a step logged twice (a run resumed from a checkpoint
older than its last log line) keeps its last value. Panels come in this order: loss, lr, grad_norm,
tokens_per_s; then ``eval/*``; then the algorithm's own metrics (rewards, kl, nll, ...) as they
first appear; peak_mem_mb last. A panel repeating an earlier one (one quantity under two related names,
equal in every run: :func:`drop_repeats`) is left out and named in the earlier one's title. The legend
names the runs (several) and the smoothing of a long series (faint as logged, bold a moving average); under a
one-run figure's title it goes below the panels. A y-axis spans at least 5% of its values' magnitude.

Only matplotlib's object API is used (``Figure`` on the Agg canvas, never ``pyplot``): nothing
needs a display, and a caller's own pyplot figures and backend are left alone. No torch here.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from alignkit.errors import ConfigError, DataError, UnknownNameError
from alignkit.plot_axes import honest_ylim, moving_average, panel_title, window

log = logging.getLogger("alignkit")

METRICS_FILE = "metrics.jsonl"
NOT_PANELS = ("time", "step", "epoch")
FIRST = ("loss", "lr", "grad_norm", "tokens_per_s")
LAST = ("peak_mem_mb",)
#: runs of the flow image policies (``algorithm`` in their config.yaml): their panels follow FLOW_ORDER
FLOW_ALGORITHMS = ("flow_grpo", "flow_rtpo")
#: a flow run's reading order, for the flow_grpo policy's metrics and again for flow_rtpo's image policy's
#: (``image/`` prefix): the reward and its terms (each scorer, the CVaR bonus, VaR), the update's KL, clipping and
#: ratio, the advantages; then the timings (FLOW_TIMES); globs as in ``--metrics``
FLOW_ORDER = ("reward_mean", "reward/*", "cvar_bonus_mean", "var", "kl", "approx_kl", "clip_fraction", "ratio",
              "policy_loss", "advantage_*", "reward_std", "frac_reward_zero_std", "reward_scored")
FLOW_TIMES = ("sample_s", "rollout_s", "update_s", "time/*")
#: token throughputs, always 0 in a flow_grpo run (it trains on images): no panels there
NO_TOKENS = ("tokens_per_s", "train_tokens_per_s")
#: drawn on a log y-axis when all their values are positive and span more than two decades
LOG_WHEN_WIDE = ("loss", "eval/loss", "grad_norm")
MAX_COLUMNS = 4
PANEL_INCHES = (4.2, 2.9)
#: series with at least this many points also get a moving average (the raw line stays, faint)
SMOOTH_FROM = 80


class Plotted(NamedTuple):
    path: Path
    panels: list[str]


@dataclass
class RunMetrics:
    """One run's metrics: ``series[name] = (steps, values)`` sorted by step; NaN where ``null`` was logged."""

    name: str
    file: Path
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    algorithm: str | None = None


# ---------------------------------------------------------------------------------------- reading
def metrics_file(run: str | Path) -> Path:
    """``RUN_DIR/metrics.jsonl`` (a path to the file itself is accepted too)."""
    p = Path(run)
    if p.is_file():
        return p
    if not p.exists():
        raise DataError(f"{p}: no such run directory")
    f = p / METRICS_FILE
    if not f.is_file():
        raise DataError(f"{f} not found (a run writes it when logging.report_to has jsonl)")
    return f


def read_metrics(path: Path, name: str | None = None) -> RunMetrics:
    """Parse one metrics.jsonl. A truncated last line (a run killed mid-write) is skipped; any other
    line that is not a JSON object with a numeric ``step`` is an error naming file and line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    by_metric: dict[str, dict[float, float]] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue
            raise DataError(f"{path}:{n}: not a JSON line") from None
        step = row.get("step") if isinstance(row, dict) else None
        if not _is_number(step):
            raise DataError(f"{path}:{n}: expected a JSON object with a numeric 'step'")
        for key, value in row.items():
            if key in NOT_PANELS or not (value is None or _is_number(value)):
                continue
            # a later line for the same step wins: a resumed run re-logs the steps after its checkpoint
            by_metric.setdefault(key, {})[step] = math.nan if value is None else float(value)
    if not by_metric:
        raise DataError(f"{path}: no metric rows (empty file)")
    run = RunMetrics(name or path.parent.name, path, algorithm=_algorithm_of(path.parent))
    for key, points in by_metric.items():
        steps = sorted(points)
        run.series[key] = (steps, [points[s] for s in steps])
    return run


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _algorithm_of(run_dir: Path) -> str | None:
    """``algorithm`` from the resolved config.yaml a run writes beside its metrics, if any."""
    try:
        import yaml

        algo = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")).get("algorithm")
        return str(algo) if algo else None
    except Exception:  # no config.yaml, or not one of ours: the plot just lacks the name
        return None


def run_names(paths: Sequence[str | Path]) -> list[str]:
    """Folder names, lengthened with parent folders where two are equal (``a/run``, ``b/run``);
    the same folder given twice gets ``(2)``."""
    dirs = []
    for p in paths:
        p = Path(os.path.abspath(p))
        dirs.append((p.parent if p.is_file() else p).parts)
    unique = list(dict.fromkeys(dirs))
    depth = [1] * len(unique)
    while True:
        names = ["/".join(pp[-d:]) for pp, d in zip(unique, depth)]
        clash = [i for i, nm in enumerate(names) if names.count(nm) > 1 and depth[i] < len(unique[i]) - 1]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    name_of = dict(zip(unique, names))
    seen: dict[tuple[str, ...], int] = {}
    out = []
    for d in dirs:
        seen[d] = seen.get(d, 0) + 1
        out.append(name_of[d] if seen[d] == 1 else f"{name_of[d]} ({seen[d]})")
    return out


# ---------------------------------------------------------------------------------------- choosing
def order_metrics(names: Sequence[str], algorithms: Sequence[str | None] = ()) -> list[str]:
    """FIRST, then eval/* (eval/loss first), then the rest as given, then LAST. A flow run (``algorithms``: its
    runs' algorithms, any in FLOW_ALGORITHMS): the rest in FLOW_ORDER, unprefixed then ``image/``, then the others
    as given, then the timings; a flow_grpo run alone has no token-throughput panels (NO_TOKENS)."""
    names = list(dict.fromkeys(names))
    if any(a in FLOW_ALGORITHMS for a in algorithms):
        if set(algorithms) == {"flow_grpo"}:
            names = [m for m in names if m not in NO_TOKENS]
        names = _flow_order(names)
    first = [m for m in FIRST if m in names]
    evals = sorted((m for m in names if m.startswith("eval/")), key=lambda m: m != "eval/loss")
    last = [m for m in LAST if m in names]
    rest = [m for m in names if m not in first and m not in last and not m.startswith("eval/")]
    return first + evals + rest + last


def _flow_order(names: list[str]) -> list[str]:
    ordered: list[str] = []
    for prefix in ("", "image/"):
        for pat in FLOW_ORDER:
            ordered += [m for m in names if fnmatch.fnmatchcase(m, prefix + pat) and m not in ordered
                        and (prefix or not m.startswith("image/"))]
    times = [m for prefix in ("", "image/") for t in FLOW_TIMES for m in names
             if fnmatch.fnmatchcase(m, prefix + t) and m not in ordered]
    return ordered + [m for m in names if m not in ordered and m not in times] + times


def select_metrics(available: Sequence[str], patterns: Sequence[str] | None,
                   algorithms: Sequence[str | None] = ()) -> list[str]:
    """The panels: every available metric in :func:`order_metrics` order, or those matching
    ``patterns`` (names or globs such as ``rewards/*``), pattern by pattern. A pattern that matches
    nothing is an error naming the closest metric."""
    ordered = order_metrics(available, algorithms)
    if not patterns:
        return ordered
    chosen: list[str] = []
    for pat in patterns:
        hits = [m for m in ordered if fnmatch.fnmatchcase(m, pat)]
        if not hits:
            close = difflib.get_close_matches(pat, ordered, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownNameError(f"--metrics {pat!r} matches no metric; {hint}these are logged: {', '.join(ordered)}")
        chosen += [m for m in hits if m not in chosen]
    return chosen


def default_out(runs: Sequence[str | Path]) -> Path:
    """``RUN_DIR/plots/summary.png`` for one run; for several ``plots.png`` in the folder that holds them
    (``runs/plots.png`` for ``runs/a runs/b``), never the working directory (a clone's root, following the docs);
    runs with no common folder but the file system's root: the first run's ``plots/compare.png``."""
    if len(runs) == 1:
        return metrics_file(runs[0]).parent / "plots" / "summary.png"
    dirs = [metrics_file(r).parent.resolve() for r in runs]
    common = Path(os.path.commonpath(dirs))
    return dirs[0] / "plots" / "compare.png" if common == Path(common.anchor) else common / "plots.png"


# ---------------------------------------------------------------------------------------- drawing
def plot_runs(runs: Sequence[str | Path], out: str | Path | None = None,
              metrics: Sequence[str] | None = None) -> Plotted:
    """Read every run's metrics.jsonl and draw the chosen panels into ``out`` (PNG, or PDF/SVG by suffix).

    Returns the path written and the panel titles in drawing order.
    """
    if not runs:
        raise ConfigError("give at least one run directory")
    if out is not None:
        _image_format(Path(out))  # before reading anything
    files = [metrics_file(r) for r in runs]
    data = [read_metrics(f, nm) for f, nm in zip(files, run_names(runs))]
    available = [m for run in data for m in run.series]
    panels = select_metrics(available, metrics, [run.algorithm for run in data])
    panels, repeats = drop_repeats(data, panels) if metrics is None else (panels, {})
    path = Path(out) if out is not None else default_out(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    draw_figure(data, panels, repeats).savefig(path, format=_image_format(path))
    return Plotted(path, panels)


def drop_repeats(runs: Sequence[RunMetrics], panels: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The panels less those repeating an earlier one: one quantity logged under two names (a flow run's
    ``reward_mean``, ``reward/main`` and ``reward/main/shapes_colour`` with a single scorer; ``update_s`` and
    ``time/update_s``), i.e. related names (:func:`_family`) whose series are equal in every run. Returns the
    panels kept and, for each kept panel, the names it stands for (said in its title)."""
    kept: list[str] = []
    repeats: dict[str, list[str]] = {}
    for name in panels:
        same = next((k for k in kept if _related(k, name) and _same_series(runs, k, name)), None)
        if same is None:
            kept.append(name)
        else:
            repeats.setdefault(same, []).append(name)
    return kept, repeats


def _related(a: str, b: str) -> bool:
    """Names of one quantity: equal, or one a path under the other, once ``time/`` and ``_mean`` are set aside."""
    fa, fb = (m.removeprefix("time/").removesuffix("_mean") for m in (a, b))
    return fa == fb or fb.startswith(fa + "/") or fa.startswith(fb + "/")


def _same_series(runs: Sequence[RunMetrics], a: str, b: str) -> bool:
    both = [r for r in runs if a in r.series and b in r.series]
    if not both or any((a in r.series) != (b in r.series) for r in runs):
        return False
    import numpy as np

    return all(r.series[a][0] == r.series[b][0] and np.array_equal(r.series[a][1], r.series[b][1], equal_nan=True)
               for r in both)


def _image_format(path: Path) -> str:
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise ConfigError(f"--out {path}: unsupported image type {path.suffix!r}; use .png, .pdf or .svg")
    return fmt


def draw_figure(runs: list[RunMetrics], panels: list[str], repeats: dict[str, list[str]] | None = None) -> Any:
    """The matplotlib ``Figure`` of ``panels`` (not saved). Its legend names the runs (several) and, where a
    panel is smoothed, says how: faint = as logged, bold = the moving average and its window."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    n = len(panels)
    ncols = n if n <= 3 else min(MAX_COLUMNS, math.ceil(math.sqrt(n)))  # 4 panels: 2 x 2; 10: 4 x 3
    nrows = math.ceil(n / ncols)
    width = max(PANEL_INCHES[0] * ncols, 7.0)  # room for the title and the legend above one panel
    fig = Figure(figsize=(width, PANEL_INCHES[1] * nrows + 0.5 + 0.35 * math.ceil((len(runs) + 2) / 4)),
                 dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).flat
    # ten colours, then the same colours dashed, then dotted
    styles = [(f"C{i % 10}", ("-", "--", ":")[i // 10 % 3]) for i in range(len(runs))]
    steps = [s for run in runs for m in panels if m in run.series for s in run.series[m][0]]
    lo, hi = min(steps), max(steps)
    pad = 0.03 * (hi - lo) if hi > lo else 0.5
    windows: set[int] = set()
    for i, name in enumerate(panels):
        windows |= _panel(axes[i], name, runs, styles, (repeats or {}).get(name, []))
        axes[i].set_xlim(lo - pad, hi + pad)
        if i + ncols >= n:  # the lowest panel of its column
            axes[i].set_xlabel("step")
    for ax in axes[n:]:
        ax.remove()
    handles = [] if len(runs) == 1 else [Line2D([], [], color=c, ls=ls, lw=2, label=_label(run))
                                         for run, (c, ls) in zip(runs, styles)]
    if len(runs) == 1:
        fig.suptitle(f"{_label(runs[0])}: {runs[0].file}", fontsize=12)
    if windows:
        k = f"{max(windows)}" if len(windows) == 1 else f"up to {max(windows)}"
        handles += [Line2D([], [], color="0.3", lw=0.8, alpha=0.4, label="faint: as logged"),
                    Line2D([], [], color="0.3", lw=1.6, label=f"bold: centred moving average of {k} logged points")]
    if handles:  # under a one-run figure's title the legend would cover it: below the panels then
        fig.legend(handles=handles, loc=f"outside {'lower' if len(runs) == 1 else 'upper'} center",
                   ncols=min(len(handles), 4), frameon=False, fontsize=10)
    return fig


def _panel(ax: Any, name: str, runs: list[RunMetrics], styles: list[tuple[str, str]],
           repeats: Sequence[str] = ()) -> set[int]:
    """One metric of every run that logged it (``repeats``: further names of the same series, said in the
    title); returns the moving-average windows used (none: not smoothed)."""
    from matplotlib.ticker import MaxNLocator

    finite: list[float] = []
    gaps, smoothed = 0, set()
    for run, (color, ls) in zip(runs, styles):
        if name not in run.series:
            continue
        steps, values = run.series[name]
        if name.startswith("eval/") or len(steps) <= 30:
            ax.plot(steps, values, color=color, ls=ls, lw=1.4, marker="o", ms=3.5)
        elif len(steps) < SMOOTH_FROM or name == "lr":
            ax.plot(steps, values, color=color, ls=ls, lw=1.4)
        else:  # noisy logged values: faint as logged, bold a moving average
            k = window(len(steps))
            smoothed.add(k)
            ax.plot(steps, values, color=color, ls=ls, lw=0.8, alpha=0.3)
            ax.plot(steps, moving_average(values, k), color=color, ls=ls, lw=1.6)
        nan_steps = [s for s, v in zip(steps, values) if math.isnan(v)]
        if nan_steps:  # where the line breaks: x marks on the step axis
            ax.plot(nan_steps, [0.0] * len(nan_steps), "x", color=color, ms=6, mew=1.5,
                    transform=ax.get_xaxis_transform(), clip_on=False)
        gaps += len(nan_steps)
        finite += [v for v in values if math.isfinite(v)]
    ax.set_title(panel_title([name, *repeats]), fontsize=11 if not repeats else 9)
    if gaps:
        ax.set_title(f"{gaps} non-finite", loc="right", fontsize=8, color="0.35")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    ax.grid(True, alpha=0.3)
    if not finite:
        ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center", va="center", color="0.4")
        ax.set_yticks([])
    elif name in LOG_WHEN_WIDE and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
        ax.set_ylim(*honest_ylim(min(finite), max(finite), *ax.get_ylim()))
    return smoothed


def _label(run: RunMetrics) -> str:
    return run.name if not run.algorithm or run.algorithm == run.name else f"{run.name} ({run.algorithm})"


# ---------------------------------------------------------------------------------------- end of a run
def plot_after_run(output_dir: Path, report_to: Sequence[str]) -> Path | None:
    """The run's ``plots/summary.png`` (called on the main rank once training is done). A failure is
    a warning line, never an error: the run itself has finished and saved."""
    if "jsonl" not in report_to:
        log.info("No plot: logging.report_to has no jsonl, so there is no metrics.jsonl to draw (logging.plot=false "
                 "silences this)")
        return None
    try:
        result = plot_runs([output_dir], Path(output_dir) / "plots" / "summary.png")
    except Exception as e:  # noqa: BLE001 - a picture must never fail a finished run
        log.warning(f"Warning: could not plot {Path(output_dir) / METRICS_FILE}: {type(e).__name__}: {e}")
        return None
    log.info(f"Plotted {len(result.panels)} metrics to {result.path}")
    return result.path
