"""The report folder of a run: plots of the step metrics, a summary in Markdown and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: reports are written by CLIs and pods, never shown
import matplotlib.pyplot as plt  # noqa: E402

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
TRUNCATION_BAND = (0.15, 0.25)  # the healthy band users are told to keep (docs/metrics.md)


def signal_means(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean of each signal over the records that carry it (summary key `mean_<label>`)."""
    out: dict[str, float] = {}
    for key, label in SIGNALS:
        values = [float(r[key]) for r in records if key in r]
        if values:
            out[f"mean_{label}"] = sum(values) / len(values)
    return out


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


def _length_plot(path: Path, records: list[dict[str, Any]]) -> None:
    """Response-length distribution of the first and the last third of the run."""
    third = max(1, len(records) // 3)
    early = [x for r in records[:third] for x in r.get("lengths", [])]
    late = [x for r in records[-third:] for x in r.get("lengths", [])]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = 30
    if early:
        ax.hist(early, bins=bins, alpha=0.5, label=f"steps 1-{third}")
    if late:
        ax.hist(late, bins=bins, alpha=0.5, label=f"last {third} steps")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
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


def reward_gain(records: list[dict[str, Any]], window: int = 5) -> tuple[float, float]:
    """Mean reward of the first and of the last `window` steps."""
    rewards = [float(r["reward_mean"]) for r in records]
    w = max(1, min(window, len(rewards) // 2 or 1))
    return sum(rewards[:w]) / w, sum(rewards[-w:]) / w


def write_report(
    out_dir: Path,
    records: list[dict[str, Any]],
    comparison: dict[str, Any] | None = None,
    evals: list[dict[str, Any]] | None = None,
) -> list[Path]:
    """Write plots and summary files for the step records (and held-out evaluations); returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if records:
        steps = [int(r["step"]) for r in records]
        for name, key, label in PLOTS:
            if key not in records[-1]:  # a run recorded before this signal existed
                continue
            overlay = evals if key == "reward_mean" else None
            _line_plot(out_dir / name, steps, [float(r.get(key, 0.0)) for r in records], label, overlay)
            written.append(out_dir / name)
        _length_plot(out_dir / "length_distribution.png", records)
        written.append(out_dir / "length_distribution.png")
    summary: dict[str, Any] = {"steps": len(records)}
    if records:
        first, last = reward_gain(records)
        summary.update(
            reward_first_steps=first,
            reward_last_steps=last,
            mean_rollout_tokens_per_s=sum(r["rollout_tokens_per_s"] for r in records) / len(records),
            **signal_means(records),
            mean_off_policy_token_ratio=sum(r["off_policy_token_ratio"] for r in records) / len(records),
            final_policy_version=records[-1]["policy_version"],
        )
        summary["truncation_rate_vs_band"] = truncation_verdict(summary["mean_truncation_rate"])
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
