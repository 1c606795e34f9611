"""`windowgpt plot`: training curves of one or several runs (train_loss and val_bpb against
step and against training time), as a PNG or a self-contained HTML page.

Reads RUN/metrics.jsonl and RUN/config.json, so a run still training can be plotted.
Needs matplotlib, the optional extra `windowgpt[plot]`.
"""
from __future__ import annotations

import importlib
import io
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ArtifactError, ConfigError
from ..storage.files import atomic_write_bytes, atomic_write_text
from ..storage.outputs import check_apart, claim_file
from .info import differing_settings, read_artifact, read_metrics, short_setting

FORMATS = (".png", ".html")
# What marks a picture as plot's own, so that plot replaces it and nothing else.
PLOT_SOFTWARE = "windowgpt plot"
PLOT_HTML_MARK = f'<meta name="generator" content="{PLOT_SOFTWARE}">'
PANELS = (("train_loss", "step"), ("train_loss", "time"), ("val_bpb", "step"), ("val_bpb", "time"))


@dataclass
class RunCurves:
    name: str
    config: RunConfig
    metrics: list[dict[str, Any]]

    def series(self, metric: str, axis: str) -> tuple[list[float], list[float]]:
        """(x, y) of every record holding the metric; x is the step or training time in seconds."""
        rows = [m for m in self.metrics if isinstance(m.get(metric), (int, float)) and "step" in m]
        if axis == "time":
            rows = [m for m in rows if isinstance(m.get("train_time_ms"), (int, float))]
            return [m["train_time_ms"] / 1000 for m in rows], [m[metric] for m in rows]
        return [m["step"] for m in rows], [m[metric] for m in rows]


def load_run_curves(path: Path) -> RunCurves:
    """A run directory's curves; an export or .ptz leads to its run when that can be found."""
    path = Path(path)
    run_dir = path if (path / "metrics.jsonl").is_file() else read_artifact(path).run_dir
    if run_dir is None:
        raise ArtifactError(f"{path}: no training run found (plot reads RUN/metrics.jsonl)")
    return RunCurves(_run_name(run_dir), RunConfig.load(run_dir / "config.json"), read_metrics(run_dir))


def _run_name(run_dir: Path) -> str:
    return run_dir.resolve().name


def legend_labels(runs: list[RunCurves]) -> list[str]:
    """Each run's name and its values of the settings in which the runs differ."""
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        names = [f"{i + 1}:{n}" for i, n in enumerate(names)]
    differing = differing_settings([r.config for r in runs]) if len(runs) > 1 else {}
    labels = []
    for i, name in enumerate(names):
        settings = ", ".join(f"{short_setting(k)}={_value(v[i])}" for k, v in differing.items())
        labels.append(f"{name} ({settings})" if settings else name)
    return labels


def _value(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def _pyplot():
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ConfigError("plot needs matplotlib: pip install 'windowgpt[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    return importlib.import_module("matplotlib.pyplot")


def draw(runs: list[RunCurves]):
    """A 2 x 2 figure: train_loss and val_bpb (rows) against step and training time (columns)."""
    plt = _pyplot()
    # Each column shares its x axis: a run validated once shows its point at the end of its
    # training curve, not alone in the middle of an axis of its own.
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), dpi=80, sharex="col")
    for (metric, axis), ax in zip(PANELS, axes.flat):
        for i, run in enumerate(runs):
            x, y = run.series(metric, axis)
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, color=f"C{i}", linewidth=1.2)
            if metric == "val_bpb":  # the EMA weights' score, after the last step
                ex, ey = run.series("post_ema_val_bpb", axis)
                ax.plot(ex, ey, marker="x", linestyle="none", color=f"C{i}")
                if len(x) == 1:  # a lone point: its value written beside it
                    ax.annotate(f"{y[0]:.4f}", (x[0], y[0]), textcoords="offset points", xytext=(-6, 6),
                                ha="right", fontsize=8, color=f"C{i}")
        ax.set_xlabel("step" if axis == "step" else "training time (s)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=f"C{i}") for i in range(len(runs))]
    handles.append(plt.Line2D([], [], marker="x", linestyle="none", color="gray"))
    fig.legend(handles, [*legend_labels(runs), "post-EMA val_bpb"], loc="lower center",
               ncol=min(len(runs) + 1, 3), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(runs) // 3), 1, 1))
    return fig


def plot_runs(paths: list[Path], out: Path) -> Path:
    """Draw the runs' curves into out (.png or .html); returns out."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"--out {out}: the file must end in {' or '.join(FORMATS)}")
    if not paths:
        raise ConfigError("give at least one run directory to plot")
    check_apart(out, paths)
    return write_plot([load_run_curves(p) for p in paths], out)


def write_plot(runs: list[RunCurves], out: Path, flag: str = "--out") -> Path:
    """The runs' curves drawn into out (.png or .html), which may only replace a plot (flag
    names out in the refusal, as `storage.outputs.claim_file`)."""
    claim_file(out, "a plot", is_plot, flag=flag)
    fig = draw(runs)
    buffer = io.BytesIO()
    if out.suffix.lower() == ".png":
        fig.savefig(buffer, format="png", metadata={"Software": PLOT_SOFTWARE})
        atomic_write_bytes(out, buffer.getvalue())
    else:
        fig.savefig(buffer, format="svg")
        atomic_write_text(out, _html_page(runs, buffer.getvalue().decode("utf-8")))
    _pyplot().close(fig)
    return out


def _html_page(runs: list[RunCurves], svg: str) -> str:
    """One self-contained page: the figure as inline SVG and the runs' differing settings."""
    labels = legend_labels(runs)
    items = "".join(f"<li>{escape(label)}</li>" for label in labels)
    body = svg[svg.index("<svg"):]  # drop the XML prologue
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">{PLOT_HTML_MARK}<title>windowgpt: "
            f"{escape(', '.join(r.name for r in runs))}</title></head>\n<body>\n{body}\n<ul>{items}</ul>\n"
            "</body></html>\n")


def is_plot(path: Path) -> bool:
    """Whether a file is a picture plot wrote (its PNG text chunk, or its HTML generator tag)."""
    try:
        head = Path(path).read_bytes()[:4096]
    except OSError:
        return False
    if head.startswith(b"\x89PNG"):
        return b"Software\x00" + PLOT_SOFTWARE.encode() in head
    return PLOT_HTML_MARK.encode() in head
