"""alignkit.plot on hand-written metrics.jsonl files: reading, panel choice and order, run names, the
moving average, and (small, fast) drawings."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from alignkit.errors import ConfigError, DataError, UnknownNameError, UserError
from alignkit.plot import (
    moving_average,
    order_metrics,
    plot_after_run,
    plot_runs,
    read_metrics,
    run_names,
    select_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, rows: list[dict[str, Any]], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"time": 1.0, **r}) + "\n" for r in rows) + tail
    (path / "metrics.jsonl").write_text(text, encoding="utf-8")
    return path


def train_row(step: int, **extra: Any) -> dict[str, Any]:
    return {"epoch": step / 10, "loss": 1.0 / step, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1000.0,
            "peak_mem_mb": 300.0, "step": step, **extra}


def test_read_skips_bookkeeping_keeps_nulls_as_gaps_and_the_last_value_per_step(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", [
        train_row(1, nll=2.0, note="text", flag=True),
        train_row(2, nll=None),
        {"eval/loss": 0.9, "step": 2},              # eval row at a step a train row has too: both kept
        train_row(3, nll=1.5),
        train_row(2, nll=1.8),                      # resumed from step 1: step 2 logged again, the later wins
        train_row(3, nll=1.4),
    ])
    m = read_metrics(run / "metrics.jsonl")
    assert m.name == "r"
    assert set(m.series) == {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb", "nll", "eval/loss"}
    assert m.series["nll"] == ([1, 2, 3], [2.0, 1.8, 1.4])
    assert m.series["eval/loss"] == ([2], [0.9])
    run2 = write_run(tmp_path / "g", [train_row(1, kl=None), train_row(2, kl=0.1)])
    steps, values = read_metrics(run2 / "metrics.jsonl").series["kl"]
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 0.1


def test_a_truncated_last_line_is_skipped_a_bad_middle_line_is_an_error(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", [train_row(1), train_row(2)], tail='{"loss": 0.3, "st')
    assert read_metrics(run / "metrics.jsonl").series["loss"][0] == [1, 2]
    f = run / "metrics.jsonl"
    f.write_text(json.dumps(train_row(1)) + "\nnot json\n" + json.dumps(train_row(2)) + "\n")
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(f)
    f.write_text(json.dumps({"loss": 1.0}) + "\n")
    with pytest.raises(DataError, match=r"metrics.jsonl:1: expected a JSON object with a numeric 'step'"):
        read_metrics(f)


def test_missing_or_empty_metrics_are_user_errors_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(DataError) as e:
        plot_runs([tmp_path / "run"])
    assert str(e.value).startswith(f"{tmp_path / 'run' / 'metrics.jsonl'} not found")
    with pytest.raises(DataError, match="no such run directory"):
        plot_runs([tmp_path / "nowhere"])
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match=r"metrics.jsonl: no metric rows \(empty file\)"):
        plot_runs([tmp_path / "run"])
    assert issubclass(DataError, UserError)


def test_panel_order() -> None:
    logged = ["peak_mem_mb", "kl", "tokens_per_s", "eval/kl", "loss", "rewards/accuracy", "eval/loss", "lr",
              "grad_norm", "kl"]
    assert order_metrics(logged) == ["loss", "lr", "grad_norm", "tokens_per_s", "eval/loss", "eval/kl", "kl",
                                     "rewards/accuracy", "peak_mem_mb"]


def test_select_by_names_and_globs_in_the_order_asked() -> None:
    logged = ["loss", "lr", "eval/loss", "eval/rewards/accuracy", "rewards/accuracy", "rewards/margin", "kl"]
    assert select_metrics(logged, None) == order_metrics(logged)
    assert select_metrics(logged, ["rewards/*", "loss"]) == ["rewards/accuracy", "rewards/margin", "loss"]
    assert select_metrics(logged, ["*accuracy", "rewards/*"]) == ["eval/rewards/accuracy", "rewards/accuracy",
                                                                  "rewards/margin"]
    with pytest.raises(UnknownNameError, match=r"--metrics 'rewards/acuracy' matches no metric; did you mean "
                                               r"'rewards/accuracy'\?"):
        select_metrics(logged, ["rewards/acuracy"])


def test_run_names_are_folder_names_lengthened_where_equal(tmp_path: Path) -> None:
    assert run_names(["x/sft", "y/dpo"]) == ["sft", "dpo"]
    assert run_names(["a/run", "b/run", "c"]) == ["a/run", "b/run", "c"]
    assert run_names(["a/b/run", "c/b/run"]) == ["a/b/run", "c/b/run"]
    same = str(tmp_path / "r")
    assert run_names([same, same]) == ["r", "r (2)"]
    f = write_run(tmp_path / "given", [train_row(1)]) / "metrics.jsonl"
    assert run_names([f]) == ["given"]


def test_moving_average_is_centred_and_keeps_gaps() -> None:
    nan = math.nan
    got = moving_average([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3)
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # a straight line stays straight, ends included
    got = moving_average([1.0, nan, 3.0, 5.0], 3)
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 4.0 and got[3] == 5.0


def test_draws_every_panel_with_gaps_and_runs_lacking_a_metric(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [train_row(s, kl=None if s == 2 else 0.1 * s, nan_all=None)
                                   for s in range(1, 6)] + [{"eval/loss": 0.5, "step": 5}])
    b = write_run(tmp_path / "b", [train_row(s) for s in range(1, 4)])
    path, panels = plot_runs([a, b], tmp_path / "out" / "ab.png")
    assert panels == ["loss", "lr", "grad_norm", "tokens_per_s", "eval/loss", "kl", "nan_all", "peak_mem_mb"]
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    path, panels = plot_runs([a], metrics=["kl"])
    assert path == a / "plots" / "summary.png" and panels == ["kl"] and path.is_file()
    with pytest.raises(ConfigError, match="unsupported image type '.jpgx'"):
        plot_runs([a], tmp_path / "x.jpgx")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def alignkit_log() -> Any:
    log = logging.getLogger("alignkit")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


def test_end_of_run_plot_never_raises(tmp_path: Path, alignkit_log: list[tuple[int, str]]) -> None:
    run = write_run(tmp_path / "run", [train_row(1), train_row(2)])
    assert plot_after_run(run, ["console"]) is None
    assert alignkit_log[-1][1].startswith("No plot: logging.report_to has no jsonl")
    assert plot_after_run(run, ["jsonl"]) == run / "plots" / "summary.png"
    assert alignkit_log[-1] == (logging.INFO, f"Plotted 5 metrics to {run / 'plots' / 'summary.png'}")
    (run / "metrics.jsonl").write_text("")
    assert plot_after_run(run, ["jsonl"]) is None
    level, msg = alignkit_log[-1]
    assert level == logging.WARNING and msg.startswith(f"Warning: could not plot {run / 'metrics.jsonl'}: DataError:")


def test_repeated_panels_are_dropped_and_named_in_the_kept_title(tmp_path: Path) -> None:
    """One quantity under related names (a flow run's reward_mean = reward/main = reward/main/shapes_colour with
    one scorer; update_s = time/update_s) is one panel; unrelated names with equal values (kl and clip_fraction
    both 0) and related names that differ somewhere stay."""
    from alignkit.plot import draw_figure, drop_repeats

    rows = [{"step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s, "reward/main": 0.1 * s,
             "reward/main/shapes_colour": 0.1 * s, "reward/quality": 0.1 * s if s < 3 else 0.0, "kl": 0.0,
             "clip_fraction": 0.0, "update_s": 2.0 + s, "time/update_s": 2.0 + s} for s in range(1, 4)]
    run = read_metrics(write_run(tmp_path / "flow", rows) / "metrics.jsonl")
    panels, repeats = drop_repeats([run], order_metrics(list(run.series)))
    assert panels == ["loss", "reward_mean", "reward/quality", "kl", "clip_fraction", "update_s"]
    assert repeats == {"reward_mean": ["reward/main", "reward/main/shapes_colour"], "update_s": ["time/update_s"]}
    titles = [ax.get_title() for ax in draw_figure([run], panels, repeats).axes]
    assert titles[1] == "reward_mean\n= reward/main\n= reward/main/shapes_colour"  # a line a name: the panel's width
    assert titles[-1] == "update_s = time/update_s"
    # equal in one run only: both kept; asked for by --metrics: both kept
    other = read_metrics(write_run(tmp_path / "b", [dict(r, **{"reward/main": 0.5}) for r in rows]) / "metrics.jsonl")
    assert "reward/main" in drop_repeats([run, other], ["reward_mean", "reward/main"])[0]
    assert plot_runs([tmp_path / "flow"], tmp_path / "sel.png", metrics=["reward*"]).panels == [
        "reward_mean", "reward/main", "reward/main/shapes_colour", "reward/quality"]


def test_the_legend_names_the_overlaid_runs_and_the_smoothing(tmp_path: Path) -> None:
    from alignkit.plot import draw_figure

    short = read_metrics(write_run(tmp_path / "x" / "sft", [train_row(s) for s in range(1, 6)]) / "metrics.jsonl")
    long = read_metrics(write_run(tmp_path / "y" / "dpo", [train_row(s) for s in range(1, 201)]) / "metrics.jsonl")
    short.name, long.name = run_names([tmp_path / "x" / "sft", tmp_path / "y" / "dpo"])

    def legend(runs: list[Any]) -> list[str]:
        fig = draw_figure(runs, ["loss", "lr"])
        return [t.get_text() for lg in fig.legends for t in lg.get_texts()]

    assert legend([short, long]) == ["sft", "dpo", "faint: as logged", "bold: centred moving average of 5 logged points"]
    assert legend([short]) == []  # one run: its name is the title, nothing is smoothed
    assert legend([long])[-1] == "bold: centred moving average of 5 logged points"


def _flow_like_run(tmp_path: Path) -> Any:
    """One flow_grpo-like run of 120 logged steps (smoothed panels: the legend's two lines), a reward logged under
    three equal names (one panel with a long title) and a distinct_fraction between 0.994 and 1.0."""
    rows = [{"step": s, "loss": 0.1 + 0.01 * math.sin(s), "reward_mean": 0.3 + 0.002 * s,
             "reward/main": 0.3 + 0.002 * s, "reward/main/shapes_colour": 0.3 + 0.002 * s,
             "distinct_fraction": 0.994 if s % 20 == 0 else 1.0} for s in range(1, 121)]
    run = write_run(tmp_path / "flow", rows)
    (run / "config.yaml").write_text("algorithm: flow_grpo\n", encoding="utf-8")
    return read_metrics(run / "metrics.jsonl")


def test_one_runs_title_legend_and_long_panel_titles_do_not_collide_or_leave_the_figure(tmp_path: Path) -> None:
    """Before (issue 50): the figure title was drawn over the legend of a smoothed one-run figure, and the panel
    titled 'reward_mean = reward/main = reward/main/shapes_colour' ran past the figure's right edge."""
    from alignkit.plot import draw_figure, drop_repeats

    run = _flow_like_run(tmp_path)
    panels, repeats = drop_repeats([run], ["loss", "reward_mean", "reward/main", "reward/main/shapes_colour",
                                           "distinct_fraction"])
    assert panels == ["loss", "reward_mean", "distinct_fraction"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = draw_figure([run], panels, repeats)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # the constrained layout places everything
    title = fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)
    legend = fig.legends[0].get_window_extent(renderer)
    assert title and not title.overlaps(legend), (title, legend)
    page = fig.bbox
    for ax in fig.axes:
        box = ax.title.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and not box.overlaps(legend), (ax.title.get_text(), box, page)
        assert not title.overlaps(box)


def test_a_tiny_range_is_drawn_on_an_axis_of_at_least_five_percent_of_its_magnitude(tmp_path: Path) -> None:
    """distinct_fraction 0.994-1.0: autoscaled, the 0.6% dip filled the panel's height like a cliff; the axis now
    spans at least 5% of 1.0 (the dip is an eighth of it at most). A wide range keeps matplotlib's autoscale."""
    from alignkit.plot import draw_figure
    from alignkit.plot_axes import MIN_SPAN, honest_ylim

    run = _flow_like_run(tmp_path)
    fig = draw_figure([run], ["loss", "distinct_fraction"])
    lo, hi = fig.axes[1].get_ylim()
    assert hi - lo >= MIN_SPAN * 1.0 - 1e-12 and lo <= 0.994 and hi >= 1.0
    assert (1.0 - 0.994) / (hi - lo) <= 0.125
    assert honest_ylim(0.994, 1.0, 0.9937, 1.0003) == pytest.approx((0.972, 1.022))
    assert honest_ylim(-2.0, 3.0, -2.25, 3.25) == (-2.25, 3.25)
    assert honest_ylim(0.0, 0.0, -0.05, 0.05) == (-0.05, 0.05)  # all zero: no magnitude to widen to
