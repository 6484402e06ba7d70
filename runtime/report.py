"""The report folder of a run: plots of the step metrics, a summary in Markdown and JSON.

The history comes from the run's metrics.jsonl on disk, streamed (`read_history`): a report keeps one
number per plotted metric per step and the response lengths of the first and last third of the steps,
never every step record with its per-sample lists (rank 0 rebuilds the report at every checkpoint of
runs that may last days).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: reports are written by CLIs and pods, never shown
import matplotlib.pyplot as plt  # noqa: E402

from rljob.api.spec import TruncationBand  # noqa: E402
from rljob.runtime.metrics import current_names  # noqa: E402

PLOTS: list[tuple[str, str, str]] = [
    ("reward.png", "reward_mean", "reward (mean of trained batch)"),
    ("throughput.png", "rollout_tokens_per_s", "rollout tokens / s"),
    ("truncation_rate.png", "truncation_rate", "truncation rate (cut by the threshold / launched)"),
    ("off_policy_ratio.png", "off_policy_token_ratio", "off-policy token ratio"),
    ("goodput.png", "goodput_tokens_per_s", "goodput (trained tokens / wall s)"),
]

# The signals of docs/metrics.md, one meaning each, shown side by side: (jsonl key, summary label).
# Records written before a signal existed lack its key; the summary leaves that signal out.
SIGNALS: list[tuple[str, str]] = [
    ("truncation_rate", "truncation_rate"),
    ("partial_rate", "partial_rate"),
    ("goodput_tokens_per_s", "goodput_tokens_per_s"),
    ("aborted_token_share", "aborted_token_share"),
    ("trainer_idle_seconds", "trainer_idle_seconds_per_step"),
    ("engine_idle_seconds", "engine_idle_seconds_per_step"),
]
# The spec's default healthy band (docs/metrics.md); a job may set its own (spec.autotune.truncationBand).
TRUNCATION_BAND = (TruncationBand().low, TruncationBand().high)


def truncation_verdict(mean_rate: float, band: tuple[float, float] = TRUNCATION_BAND) -> str:
    """Where the mean truncation rate lands against the band, in words, with the usual cause."""
    low, high = band
    name = f"the {low:.0%}-{high:.0%} band"
    if mean_rate < low:
        return (f"below {name}: the length threshold cuts few samples. The segment cap is mean + k·σ but never "
                "below maxResponseLength / (maxStaleness + 1), and over-sampling ends rounds before long samples "
                "reach it (they count in the partial rate); lower k, or raise maxStaleness to lower that floor")
    if mean_rate > high:
        return f"above {name}: the length threshold cuts too many samples; raise k"
    return f"inside {name}"


# The step metrics a report keeps, one number per step each: those plotted, the signals, the rest of the summary.
SERIES = tuple(dict.fromkeys([key for _, key, _ in PLOTS] + [key for key, _ in SIGNALS] + ["reward_mean"]))


@dataclass
class RunHistory:
    """What a report needs of a run's steps (see the module docstring). A record written before a
    signal existed lacks its key: that series holds the steps that carry it (`series_steps`)."""

    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=lambda: {key: [] for key in SERIES})
    series_steps: dict[str, list[int]] = field(default_factory=lambda: {key: [] for key in SERIES})
    final_policy_version: int = 0
    third: int = 1  # steps in each of the two thirds whose lengths the distribution plot compares
    early_lengths: list[int] = field(default_factory=list)
    late_lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def mean(self, key: str) -> float | None:
        """The mean of a series over the steps that carry it; None when none does."""
        values = self.series[key]
        return sum(values) / len(values) if values else None


def signal_means(history: RunHistory) -> dict[str, float]:
    """Mean of each signal over the steps that carry it (summary key `mean_<label>`)."""
    means = {f"mean_{label}": history.mean(key) for key, label in SIGNALS}
    return {name: value for name, value in means.items() if value is not None}


def history_of(records: Iterable[dict[str, Any]], count: int) -> RunHistory:
    """The history of the first `count` step records of `records`, taken one at a time."""
    third = max(1, count // 3)
    history = RunHistory(third=third)
    for index, record in enumerate(itertools.islice(records, count)):
        step = int(record["step"])
        history.steps.append(step)
        for key in SERIES:
            if key in record:
                history.series[key].append(float(record[key]))
                history.series_steps[key].append(step)
        history.final_policy_version = int(record["policy_version"])
        if index < third:
            history.early_lengths.extend(record.get("lengths", []))
        if index >= count - third:
            history.late_lengths.extend(record.get("lengths", []))
    return history


def _lines(path: Path) -> Iterator[str]:
    with path.open() as f:
        yield from (line for line in f if line.strip())


def read_history(path: Path) -> RunHistory:
    """Stream a metrics.jsonl file into a `RunHistory` (two passes: which steps are the last third
    depends on the count). Lines appended after the count are left to the next report."""
    count = sum(1 for _ in _lines(path))
    return history_of((current_names(json.loads(line)) for line in _lines(path)), count)


def _moving_average(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _line_plot(
    path: Path, steps: list[int], values: list[float], ylabel: str, overlay: list[dict[str, Any]] | None = None
) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    per_step = "trained batch, per step" if overlay else "per step"
    ax.plot(steps, values, marker="o", markersize=3, linewidth=1, alpha=0.6, label=per_step)
    if len(values) >= 5:
        ax.plot(steps, _moving_average(values), linewidth=2, label="moving average (5)")
    if overlay:
        ax.plot([e["step"] for e in overlay], [e["reward_mean"] for e in overlay], marker="s", linewidth=2,
                color="black", label=f"held-out evaluation ({overlay[0]['prompts']} prompts)")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _length_plot(path: Path, history: RunHistory) -> None:
    """Response-length distribution of the first and the last third of the run."""
    third, early, late = history.third, history.early_lengths, history.late_lengths
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = 30
    if early:
        ax.hist(early, bins=bins, alpha=0.5, label=f"steps 1-{third}")
    if late:
        ax.hist(late, bins=bins, alpha=0.5, label=f"last {third} steps")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    if early or late:  # a run recorded without lengths draws empty axes, with no legend to show
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison_plot(path: Path, rows: list[dict[str, Any]], ceiling: float, title: str) -> None:
    """Bar chart of rollout tokens/s per strategy against the bubble-free ceiling."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [str(r["strategy"]) for r in rows]
    values = [float(r["tokens_per_s"]) for r in rows]
    bars = ax.bar(names, values, color=["#999999", "#2a7ab9", "#5aa05a", "#c0504d"][: len(rows)])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=9)
    if ceiling:
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"bubble-free ceiling {ceiling:.0f}")
        ax.legend(fontsize=8)
    ax.set_ylabel("rollout tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reward_gain(history: RunHistory, window: int = 5) -> tuple[float, float]:
    """Mean reward of the first and of the last `window` steps."""
    rewards = history.series["reward_mean"]
    w = max(1, min(window, len(rewards) // 2 or 1))
    return sum(rewards[:w]) / w, sum(rewards[-w:]) / w


def write_report(
    out_dir: Path,
    history: RunHistory,
    comparison: dict[str, Any] | None = None,
    evals: list[dict[str, Any]] | None = None,
    band: tuple[float, float] = TRUNCATION_BAND,
) -> list[Path]:
    """Write plots and summary files for a run's step history (and held-out evaluations); returns the files.
    ``band``: the job's healthy truncation-rate band (spec.autotune.truncationBand), which the summary's
    truncation verdict is against."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if history:
        for name, key, label in PLOTS:
            if not history.series[key]:  # a run recorded before this signal existed
                continue
            overlay = evals if key == "reward_mean" else None
            _line_plot(out_dir / name, history.series_steps[key], history.series[key], label, overlay)
            written.append(out_dir / name)
        _length_plot(out_dir / "length_distribution.png", history)
        written.append(out_dir / "length_distribution.png")
    summary: dict[str, Any] = {"steps": len(history)}
    if history:
        first, last = reward_gain(history)
        summary.update(
            reward_first_steps=first,
            reward_last_steps=last,
            mean_rollout_tokens_per_s=history.mean("rollout_tokens_per_s"),
            **signal_means(history),
            mean_off_policy_token_ratio=history.mean("off_policy_token_ratio"),
            final_policy_version=history.final_policy_version,
        )
        summary["truncation_rate_vs_band"] = truncation_verdict(summary["mean_truncation_rate"], band)
    if evals:
        summary.update(
            eval_reward_first=evals[0]["reward_mean"],
            eval_reward_first_step=evals[0]["step"],
            eval_reward_last=evals[-1]["reward_mean"],
            eval_reward_last_step=evals[-1]["step"],
            eval_prompts=evals[-1]["prompts"],
        )
    if comparison:
        summary["comparison"] = comparison
        comparison_plot(out_dir / "rollout_comparison.png", comparison["rows"], comparison["ceiling_tokens_per_s"],
                        "rollout throughput, same prompts and seeds")
        written.append(out_dir / "rollout_comparison.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    written.append(out_dir / "summary.json")
    lines = ["# rljob run report", ""]
    for key, value in summary.items():
        if key != "comparison":
            lines.append(f"- {key}: {value:.4g}" if isinstance(value, float) else f"- {key}: {value}")
    lines += ["", *[f"![{p.stem}]({p.name})" for p in written if p.suffix == ".png"], ""]
    (out_dir / "README.md").write_text("\n".join(lines))
    written.append(out_dir / "README.md")
    return written
