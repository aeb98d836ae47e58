"""`megaresil report RUN_DIR [--compare RUN_DIR ...] [--out DIR]`: a
self-contained HTML page (images inlined) and its PNGs, from the run
directories' own records: metrics.jsonl, events.jsonl, stragglers.jsonl.

Panels: loss and eval loss (every run overlaid), throughput and MFU over
wall time, a timeline of the first run (steps over time with restarts,
checkpoints, faults, alarms and stragglers marked), its per-rank straggler
heat map, the goodput breakdown of every run and, for a mixture of experts,
the first run's load per layer and expert (`experts`)."""
from __future__ import annotations

import base64
import html
import io
import json
import statistics
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

from megaresil.observe.goodput import BUCKETS, compute_goodput, launched_at
from megaresil.run_records import events_of, metrics_of, windows_of
from megaresil.safe_files import own_dir, write_atomic

PANELS = ("loss", "throughput", "timeline", "stragglers", "goodput")
MOE_PANEL = "experts"  # after PANELS, where the first run has experts
MARKS = {  # event -> (label, colour, marker)
    "fault_injected": ("fault", "black", "x"),
    "hang_detected": ("hang detected", "red", "v"),
    "worker_error": ("worker error", "orange", "v"),
    "restart": ("restart", "purple", "^"),
    "checkpoint_saved": ("checkpoint", "green", "|"),
    "checkpoint_loaded": ("checkpoint loaded", "teal", "o"),
    "preempted": ("preempted", "brown", "s"),
    "straggler_detected": ("straggler", "magenta", "D"),
    "hang_suspected": ("hang suspected", "gold", "v"),
}


@dataclass
class Run:
    path: Path
    name: str
    metrics: list[dict]
    events: list[dict]
    windows: list[dict]

    @classmethod
    def read(cls, path: Path) -> "Run":
        """The run's records, each of the kind the panels compute with
        (events.DamagedRecord, naming the line, otherwise)."""
        if not (path / "metrics.jsonl").exists():
            raise FileNotFoundError(f"{path}: no metrics.jsonl here. Fix: give a run directory "
                                    "(run.dir of a `megaresil train`).")
        return cls(path, path.name, metrics_of(path), events_of(path), windows_of(path))

    @property
    def steps(self) -> list[dict]:
        """The kept computation of every step (a step redone after a restart
        replaces its earlier copy), in step order."""
        kept = {r["step"]: r for r in self.metrics if "loss" in r}
        return [kept[s] for s in sorted(kept)]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.metrics if "eval_loss" in r]

    @property
    def start(self) -> float:
        return launched_at(self.events, [r for r in self.metrics if "loss" in r]) or 0.0

    def goodput(self) -> dict:
        return compute_goodput(self.events, self.metrics)

    @property
    def records(self) -> list[dict]:
        """Every step record as computed (redone steps twice), in time order."""
        return sorted((r for r in self.metrics if "loss" in r), key=lambda r: r["time"])


def broken_at_launches(run: Run, value: Callable[[dict], float]) -> tuple[list, list]:
    """(minutes since launch, value) of every step record, with a gap (NaN)
    wherever a generation started between two records: a line drawn across
    a relaunch would claim throughput while nothing ran."""
    starts = sorted(e["time"] for e in run.events if e["event"] == "generation_started")
    minutes, values, previous = [], [], None
    for record in run.records:
        if previous is not None and any(previous < t < record["time"] for t in starts):
            minutes.append(float("nan"))
            values.append(float("nan"))
        minutes.append((record["time"] - run.start) / 60)
        values.append(value(record))
        previous = record["time"]
    return minutes, values


def event_step(event: dict, records: list[dict]) -> float:
    """The step an event belongs to: its own `step`, a straggler window's last
    step, else the step under way when it happened (one past the last done)."""
    if event.get("step") is not None:
        return event["step"]
    if event.get("window"):
        return event["window"][-1]
    done = [r["step"] for r in records if r["time"] <= event["time"]]
    return (done[-1] if done else 0) + 1


def figure(draw: Callable[[plt.Axes], None], width: float = 8, height: float = 3.6):
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    draw(ax)
    fig.tight_layout()
    return fig


def loss_panel(runs: list[Run]):
    def draw(ax):
        for i, run in enumerate(runs):
            colour = f"C{i}"
            steps = run.steps
            ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color=colour,
                    label=f"{run.name} loss", linestyle="-" if i == 0 else "--")
            if run.evals:
                ax.plot([r["step"] for r in run.evals], [r["eval_loss"] for r in run.evals],
                        "o", color=colour, label=f"{run.name} eval")
        ax.set(xlabel="step", ylabel="loss", title="Loss (runs overlaid)")
        ax.legend(fontsize=7)
    return figure(draw)


def throughput_panel(runs: list[Run]):
    def draw(ax):
        mfu_ax = ax.twinx()
        for i, run in enumerate(runs):
            ax.plot(*broken_at_launches(run, lambda r: r["tokens_per_s"]), ".-",
                    color=f"C{i}", label=f"{run.name} tok/s", markersize=3)
            if any("mfu" in r for r in run.records):
                mfu = broken_at_launches(run, lambda r: 100 * r.get("mfu", float("nan")))
                mfu_ax.plot(*mfu, ":", color=f"C{i}", label=f"{run.name} MFU %")
        ax.set(xlabel="minutes since launch", ylabel="tokens/s", title="Throughput and MFU")
        mfu_ax.set_ylabel("MFU %")
        lines = ax.get_legend_handles_labels()
        more = mfu_ax.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.12, 1.0))  # beside the plot: it covers no point
    return figure(draw, width=9.5)


def timeline_panel(run: Run):
    def draw(ax):
        records = run.records
        minutes = [(r["time"] - run.start) / 60 for r in records]
        ax.plot(minutes, [r["step"] for r in records], ".", color="grey", markersize=3,
                label="step completed")
        for event, (label, colour, marker) in MARKS.items():
            hits = [e for e in run.events if e["event"] == event]
            if hits:
                ax.plot([(e["time"] - run.start) / 60 for e in hits],
                        [event_step(e, records) for e in hits], marker, color=colour,
                        linestyle="none", label=f"{label} ({len(hits)})", markersize=7)
        ax.set(xlabel="minutes since launch", ylabel="step", title=f"Timeline: {run.name}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot
    return figure(draw, width=9.5)


def straggler_matrix(run: Run) -> tuple[list[int], list[str], list[list[float]]]:
    """(ranks, window labels, worst section ratio per rank and window)."""
    ranks = sorted({int(r) for w in run.windows for r in w["ratios"]})
    labels = [f"{w['window'][0]}-{w['window'][1]}" for w in run.windows]
    cells = [[max(w["ratios"].get(str(rank), {}).values(), default=float("nan"))
              for w in run.windows] for rank in ranks]
    return ranks, labels, cells


def straggler_panel(run: Run):
    def draw(ax):
        ranks, labels, cells = straggler_matrix(run)
        if not ranks:
            ax.text(0.5, 0.5, "no straggler windows recorded\n(logging.straggler_interval "
                    "steps not reached, or 0)", ha="center", va="center")
            ax.set_axis_off()
            return
        image = ax.imshow(cells, aspect="auto", cmap="viridis", vmin=1.0,
                          vmax=max(2.0, max(max(row) for row in cells)))
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        step = max(1, len(labels) // 12)
        ax.set_xticks(range(0, len(labels), step), labels[::step], rotation=45, fontsize=7)
        ax.set(xlabel="window (steps)", title="Slowest section vs peers' median "
               "(training-thread CPU time)")
        plt.colorbar(image, ax=ax, label="ratio")
        if any(cell != cell for row in cells for cell in row):  # NaN: a rank absent
            ax.annotate("blank: the rank was not in the job in that window (the layout or "
                        "world changed on a resume or an elastic restart)", (0, 0),
                        xycoords="figure fraction", xytext=(4, 4), textcoords="offset points",
                        fontsize=7)
    return figure(draw, height=max(2.5, 0.35 * len({r for w in run.windows
                                                     for r in w["ratios"]}) + 1.5))


def goodput_panel(runs: list[Run]):
    def draw(ax):
        for i, run in enumerate(runs):
            figures, left = run.goodput(), 0.0
            for j, bucket in enumerate(BUCKETS):
                width = max(0.0, figures[f"{bucket}_s"])
                ax.barh(i, width, left=left, color=f"C{j}", label=bucket if i == 0 else None)
                left += width
            ax.text(left, i, f"  goodput {figures['goodput']:.1%}", va="center", fontsize=8)
        ax.set_yticks(range(len(runs)), [run.name for run in runs])
        ax.set(xlabel="seconds of wall time", title="Goodput: where the wall time went")
        ax.legend(fontsize=7, ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return figure(draw, height=2.4 + 0.6 * len(runs))


def expert_load(run: Run) -> tuple[list[str], list[list[float]]]:
    """(MoE layer ids, per layer each expert's tokens over the run's
    `moe_load` lines over the layer's mean: 1.0 balanced, 0 never chosen)."""
    totals: dict[str, list[float]] = {}
    for record in run.steps:
        for layer, counts in record.get("moe_load", {}).items():
            row = totals.setdefault(layer, [0.0] * len(counts))
            totals[layer] = [a + b for a, b in zip(row, counts)]
    layers = sorted(totals, key=int)
    return layers, [[c / (statistics.mean(totals[k]) or 1.0) for c in totals[k]]
                    for k in layers]


def experts_panel(run: Run):
    layers, cells = expert_load(run)

    def draw(ax):
        image = ax.imshow(cells, aspect="auto", cmap="magma", vmin=0.0,
                          vmax=max(2.0, max(max(row) for row in cells)))
        ax.set_yticks(range(len(layers)), [f"layer {k}" for k in layers], fontsize=7)
        ax.set(xlabel="expert", title=f"Tokens per expert over the run / layer mean: {run.name}")
        plt.colorbar(image, ax=ax, label="load / mean (1 balanced)")
    return figure(draw, height=max(2.5, 0.25 * len(layers) + 1.5))


def summary_rows(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        steps, g = run.steps, run.goodput()
        median = partial(median_of, steps)
        rows.append({"run": run.name, "steps": len(steps),
                     "final loss": steps[-1]["loss"] if steps else None,
                     "final eval loss": run.evals[-1]["eval_loss"] if run.evals else None,
                     "median tok/s": median("tokens_per_s"), "median TFLOP/s": median("tflops"),
                     "median MFU %": percent(median("mfu")),
                     "median step s": median("step_time_s"),
                     "peak mem MB (logging rank)": max((r.get("mem_peak_mb", 0) for r in steps),
                                                 default=None),
                     "wall s": g["wall_s"], "goodput %": percent(g["goodput"]),
                     **{f"{b} s": g[f"{b}_s"] for b in BUCKETS if b != "productive"},
                     "restarts": g.get("interruptions", 0)})
    return rows


def median_of(steps: list[dict], key: str) -> float | None:
    """The median of `key` over the steps that have it; None if none has."""
    values = [r[key] for r in steps if key in r]
    return statistics.median(values) if values else None


def percent(fraction: float | None) -> float | None:
    """MFU and goodput as the console shows them: percentages."""
    return None if fraction is None else 100 * fraction


def rank_rows(run: Run) -> list[dict]:
    """Per-rank straggler table: mean relative score, worst ratio and where, peak memory."""
    rows = []
    for rank in sorted({int(r) for w in run.windows for r in w["ratios"]}):
        key = str(rank)
        worst = max(((ratio, section) for w in run.windows
                     for section, ratio in w["ratios"].get(key, {}).items()), default=(None, ""))
        detected = [e for e in run.events if e["event"] == "straggler_detected"
                    and e.get("rank") == rank]
        rows.append({"rank": rank,
                     "mean score": statistics.mean(w["scores"][key] for w in run.windows
                                                   if key in w["scores"]),
                     "worst ratio": worst[0], "in section": worst[1],
                     "straggler_detected": len(detected),
                     "peak mem MB": max(w["mem_peak_mb"].get(key, 0) for w in run.windows)})
    return rows


def html_table(rows: list[dict]) -> str:
    if not rows:
        return "<p>none</p>"
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return html.escape("-" if v is None else str(v))
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row.values()) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(run_dir: Path, compare: Sequence[Path] = (), out: Path | None = None) -> Path:
    """Render every panel; returns the HTML page's path."""
    runs = [Run.read(Path(run_dir)), *(Run.read(Path(p)) for p in compare)]
    # The default report/ lies in a run directory that may come from elsewhere:
    # a link there is refused; an --out the user names is theirs, as named.
    out = Path(out) if out else own_dir(Path(run_dir) / "report")
    out.mkdir(parents=True, exist_ok=True)
    figures = {"loss": loss_panel(runs), "throughput": throughput_panel(runs),
               "timeline": timeline_panel(runs[0]), "stragglers": straggler_panel(runs[0]),
               "goodput": goodput_panel(runs)}
    if expert_load(runs[0])[0]:
        figures[MOE_PANEL] = experts_panel(runs[0])
    images = {}
    for name, fig in figures.items():
        png = io.BytesIO()
        fig.savefig(png, format="png")
        plt.close(fig)
        write_atomic(out / f"{name}.png", png.getvalue())  # a link in its place is replaced
        images[name] = base64.b64encode(png.getvalue()).decode()
    page = out / "index.html"
    write_atomic(page, render_html(runs, images))
    write_atomic(out / "summary.json", json.dumps({"runs": summary_rows(runs),
                                                   "ranks": rank_rows(runs[0])}, indent=1))
    return page


def render_html(runs: list[Run], images: dict[str, str]) -> str:
    stragglers = [e for e in runs[0].events if e["event"] == "straggler_detected"]
    sections = "".join(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,{data}">'
                       for name, data in images.items())
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>megaresil report: {html.escape(runs[0].name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}
table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:3px}}
img{{max-width:100%}}</style></head><body>
<h1>megaresil report: {html.escape(str(runs[0].path))}</h1>
<p>Compared with: {html.escape(", ".join(str(r.path) for r in runs[1:]) or "none")}</p>
<h2>Summary</h2>{html_table(summary_rows(runs))}
<h2>Ranks ({html.escape(runs[0].name)})</h2>{html_table(rank_rows(runs[0]))}
<h2>straggler_detected</h2>{html_table([{k: e.get(k) for k in ("rank", "section", "ratio",
                                          "window", "score")} for e in stragglers])}
{sections}</body></html>
"""
