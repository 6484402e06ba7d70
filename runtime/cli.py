"""`rljob` command line: run a job locally, validate a job file, rebuild a run's report, export, simulate."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rljob.api import RLJobConfigError, load_rljob
from rljob.api.spec import RLJob, cluster_problems
from rljob.runtime.engines.base import EngineError
from rljob.runtime.models.errors import ExportError, ModelSourceError
from rljob.runtime.rollout.round import RewardCollapse
from rljob.runtime.step_record import StepRecord
from rljob.runtime.sim.cli import add_simulate_arguments, run_simulate

if TYPE_CHECKING:
    from rljob.runtime.runner import JobRunner
    from rljob.runtime.training.distributed import Distributed

# argparse's type for the object add_subparsers returns.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

console = Console()
log = logging.getLogger("rljob")

RUN_HELP = """\
Run an RLJob on this machine: the APRIL partial-rollout loop with the embedded PyTorch engine
(spec.rollout.engine: embedded) or against SGLang workers (engine: sglang).

Each step runs one rollout round, ppoEpochs x ppoMiniBatches optimizer steps (spec.algorithm; 1 by
default) and one weight sync. The run resumes from the newest checkpoint in spec.checkpoint.dir
unless --fresh is given. At the end a report folder with plots (reward, rollout tokens/s,
truncation rate, off-policy ratio, length distribution) is written
to --output. With spec.evaluation.everySteps > 0 the policy is also scored on held-out prompts before
the first step, every N steps and after the last (the "held-out" column; eval.jsonl): under partial
rollouts that is the learning curve to read, because a training batch's reward moves with its mix
of short fresh and long resumed groups.

With --nproc N the job trains on N CPU ranks started by torch.distributed.run (torchrun): rank 0 runs
the rollouts, the engines, the metrics and this display, and hands every rank its token-balanced
share of each step's groups; all ranks train their share under FSDP2 (docs/distributed.md). Started
by torchrun yourself (RANK, WORLD_SIZE, MASTER_ADDR, ... set), `rljob run` joins that group instead.
With --max-restarts R a rank that dies (even by kill -9) restarts the whole group, which resumes from
the last checkpoint (--fresh applies to the first start only).
"""


def _step_table(rows: deque[StepRecord]) -> Table:
    table = Table(title="steps", expand=False, header_style="bold")
    for col in ("step", "reward", "held-out", "tok/s", "trunc", "off-pol", "stale", "buffer", "len μ", "rollout s",
                "train s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.step),
            f"{r.batch.reward_mean:.3f}",
            "" if r.eval_reward is None else f"{r.eval_reward:.3f}",
            f"{r.round.rollout_tokens_per_s:.0f}",
            f"{r.round.truncation_rate:.2f}",
            f"{r.batch.off_policy_token_ratio:.2f}",
            str(r.batch.staleness_max),
            str(r.round.buffer_groups),
            f"{r.batch.length_mean:.0f}",
            f"{r.round.rollout_seconds:.1f}",
            f"{r.train.train_seconds:.1f}",
        )
    return table


def comparison_view(rows: list[dict], ceiling: float, title: str) -> Table:
    """Rich table of a strategy comparison (compare.comparison_table rows) with the ceiling row."""
    table = Table(title=title, header_style="bold")
    for col in ("strategy", "tokens/s", "trained tok/s", "round s", "off-policy", "truncation", "× sync",
                "trained × sync", "× ceiling"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(row["strategy"], f"{row['tokens_per_s']:.0f}", f"{row.get('trained_tokens_per_s', 0.0):.0f}",
                      f"{row['step_seconds']:.2f}", f"{row['off_policy_ratio']:.2f}", f"{row['truncation_rate']:.2f}",
                      f"{row['over_sync']:.2f}", f"{row.get('trained_over_sync', 0.0):.2f}",
                      f"{row['over_ceiling']:.2f}")
    table.add_row("bubble-free ceiling", f"{ceiling:.0f}", "", "", "", "", "", "", "1.00")
    return table


def _run_command(args: argparse.Namespace) -> int:
    """`rljob run`: start N ranks through torchrun, or run this process's rank (or the only one)."""
    from rljob.runtime.training.distributed import DistEnv, Distributed

    env = DistEnv.from_environ()
    if args.nproc < 1:
        raise SystemExit("rljob run: --nproc must be >= 1")
    if args.nproc > 1 and env is None:
        if args.compare_rounds:
            raise SystemExit("rljob run: --compare-rounds runs in a single process; drop --nproc or --compare-rounds")
        return _launch_ranks(args)
    job = load_rljob(args.job)
    if args.checkpoint_dir:
        job.spec.checkpoint.dir = args.checkpoint_dir
    if env is None:
        return asyncio.run(_run(args, job, None))
    distributed = Distributed(env, job.spec.trainer.device)
    try:
        if distributed.is_leader:
            return asyncio.run(_run(args, job, distributed))
        from rljob.runtime.ranks import TrainingRank

        TrainingRank(job, distributed).run()
        return 0
    finally:
        distributed.close()


def _launch_ranks(args: argparse.Namespace) -> int:
    """Run this same command line on --nproc local ranks through torch.distributed.run's launcher API
    (as `torchrun --nnodes 1 --master-addr 127.0.0.1 --master-port P`); 0 when every rank succeeded.

    The static rendezvous, not `--standalone`'s c10d one: with torch 2.13 a group restarted after a
    failed rank (--max-restarts) hangs in init_process_group under the c10d rendezvous, and restarts
    cleanly under the static one."""
    import socket
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as probe:  # a free port for the agent's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()), rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, max_restarts=args.max_restarts,
        monitor_interval=1.0,
    )
    # Each rank runs `rljob run ...` again and, seeing WORLD_SIZE, joins the group instead of launching.
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "rljob.runtime.cli", *args.argv)
    except ChildFailedError as err:
        console.print(f"[red]rank failed[/] ({args.max_restarts} restarts allowed): {escape(str(err))}", soft_wrap=True)
        return 1
    return 0


def _print_start(runner: JobRunner) -> None:
    """What the set-up found: the checkpoint resumed from, newer ones passed over, the metrics endpoint."""
    if runner.resumed_from:
        console.print(f"resumed from [bold]{runner.resumed_from}[/] at step {runner.step}")
    for skipped in runner.skipped_checkpoints:
        console.print(f"[yellow]skipped the newer checkpoint {skipped}[/]")
    if runner.metrics_port:
        console.print(f"metrics on http://{runner.settings.metrics_host}:{runner.metrics_port}/metrics")


async def _run(args: argparse.Namespace, job: RLJob, distributed: Distributed | None) -> int:
    from rljob.runtime.report import write_report
    from rljob.runtime.compare import compare_strategies
    from rljob.runtime.runner import JobRunner, RunOptions

    output = Path(args.output or Path("runs") / job.metadata.name)
    # torchrun restarting a failed group: resume from the last checkpoint, never start over.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0") > 0
    fresh = args.fresh and not restarted
    runner = JobRunner(
        job,
        RunOptions(
            output_dir=output,
            steps=args.steps,
            strategy=args.strategy,
            resume=False if fresh else None,
            metrics_port=args.metrics_port,
        ),
        distributed,
    )
    from rljob.runtime.knob_sources import knob_sources_for

    runner.knob_sources.extend(knob_sources_for(job.spec, runner.step_listeners))
    if fresh:
        _start_fresh(runner)
    # Plain status lines, not a spinner: the policy warm-up shows its own progress bar, and rich
    # allows one live display at a time.
    await runner.setup(on_status=lambda msg: console.print(f"[bold]{msg}[/] …"))
    _print_start(runner)

    recent: deque[StepRecord] = deque(maxlen=args.table_rows)
    steps = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    step_task = steps.add_task("steps", total=runner.total_steps, completed=runner.step)
    round_bar = Progress(TextColumn("[bold]round {task.fields[idx]}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("{task.fields[info]}"))
    round_task = round_bar.add_task("round", total=job.spec.rollout.rollout_batch_size, idx=0, info="")

    def render() -> Group:
        p = runner.scheduler.progress
        round_bar.update(
            round_task, completed=p.accepted, idx=p.round_index,
            info=f"{p.phase} · in flight {p.in_flight_groups} groups · buffer {p.buffer_groups} · {p.tokens} tokens",
        )
        return Group(steps, round_bar, _step_table(recent))

    def on_step(rec: StepRecord) -> None:
        recent.append(rec)
        steps.update(step_task, completed=rec.step)
        if rec.step % job.spec.checkpoint.every_steps == 0:  # a crashed run keeps plots up to its last checkpoint
            _rebuild_report(output)
        if not args.live:
            console.print(
                f"step {rec.step}: reward {rec.batch.reward_mean:.3f} tok/s {rec.round.rollout_tokens_per_s:.0f} "
                f"trunc {rec.round.truncation_rate:.2f} off-policy {rec.batch.off_policy_token_ratio:.2f} buffer {rec.round.buffer_groups}"
                + ("" if rec.eval_reward is None else f" held-out reward {rec.eval_reward:.3f}")
            )

    if args.live:
        with Live(render(), console=console, refresh_per_second=4, get_renderable=render):
            summary = await runner.run(on_step)
    else:
        summary = await runner.run(on_step)
    if summary.interrupted:
        return _interrupted(summary.last_step)

    comparison = None
    if args.compare_rounds:
        with console.status(f"[bold]comparing sync and april rollouts ({args.compare_rounds} rounds each)"):
            comparison = await compare_strategies(runner, args.compare_rounds)
        console.print(comparison_view(comparison["rows"], comparison["ceiling_tokens_per_s"],
                                      "rollout throughput, same policy, prompts and seeds"))

    records, evals = _read_run(runner.metrics.jsonl_path)
    written = write_report(output / "report", records, comparison, evals)
    _print_summary(summary, records, evals, output / "report", written)
    return 0


def _start_fresh(runner: JobRunner) -> None:
    """--fresh: set the old run's checkpoints and metrics aside, so this run never resumes them and
    its pruning never deletes its own early checkpoints for the old run's higher step numbers."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = runner.checkpoints.set_aside(stamp)
    if aside is not None:
        console.print(f"--fresh: moved the previous run's checkpoints to [bold]{aside}[/]", soft_wrap=True)
    for path in (runner.metrics.jsonl_path, runner.metrics.eval_jsonl_path):
        if path is not None and path.exists():
            path.rename(path.with_name(f"{path.stem}.previous-{stamp}{path.suffix}"))


def _read_run(jsonl: Path | None) -> tuple[list[dict], list[dict]]:
    """The step records and held-out evaluations a run folder holds (metrics.jsonl, eval.jsonl)."""
    from rljob.runtime.metrics import read_jsonl

    if jsonl is None or not jsonl.exists():
        return [], []
    evals = jsonl.with_name("eval.jsonl")
    return read_jsonl(jsonl), read_jsonl(evals) if evals.exists() else []


def _rebuild_report(run_dir: Path) -> list[Path]:
    """Write RUN_DIR/report from RUN_DIR/metrics.jsonl (and eval.jsonl); the files written."""
    from rljob.runtime.report import write_report

    records, evals = _read_run(run_dir / "metrics.jsonl")
    return write_report(run_dir / "report", records, None, evals)


def _report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        console.print(f"[red]error[/]: {run_dir / 'metrics.jsonl'} does not exist; give the folder `rljob run` wrote "
                      "(its --output, default runs/<job name>)", soft_wrap=True)
        return 2
    written = _rebuild_report(run_dir)
    console.print(f"[green]report[/] rebuilt in [bold]{run_dir / 'report'}[/]: " + ", ".join(p.name for p in written),
                  soft_wrap=True)
    return 0


def _interrupted(step: int) -> int:
    """SIGTERM before the last step: say so (termination message, for the operator) and exit EXIT_INTERRUPTED.

    Never 0: a drained or evicted trainer is not a finished one.
    """
    from rljob.api.status import EXIT_INTERRUPTED, INTERRUPTED_REASON

    return _terminate(f"{INTERRUPTED_REASON}: SIGTERM after step {step}; its checkpoint is written, the next run "
                      "resumes there", EXIT_INTERRUPTED)


def _terminate(message: str, code: int) -> int:
    """Print `message`, leave it as the container's termination message (the operator reads it), return `code`."""
    from rljob.api.status import TERMINATION_MESSAGE_PATH

    console.print(message, soft_wrap=True)
    path = Path(os.environ.get("RLJOB_TERMINATION_MESSAGE_PATH", TERMINATION_MESSAGE_PATH))
    try:
        path.write_text(message)
    except OSError:
        pass  # not in a pod (or not writable there): the exit code says it
    return code


def _print_summary(summary, records, evals, report_dir: Path, written: list[Path]) -> None:  # type: ignore[no-untyped-def]
    from rljob.runtime.report import reward_gain

    table = Table(title="run summary", show_header=False)
    table.add_row("steps run", f"{summary.steps_run} (steps {summary.first_step}-{summary.last_step})")
    table.add_row("policy version", str(summary.policy_version))
    table.add_row("wall time", f"{summary.wall_seconds:.0f} s")
    if records:
        first, last = reward_gain(records)
        table.add_row("reward, first → last steps", f"{first:.3f} → {last:.3f}")
    if evals:
        table.add_row(
            f"held-out reward ({evals[-1]['prompts']} prompts)",
            f"{evals[0]['reward_mean']:.3f} (step {evals[0]['step']}) → {evals[-1]['reward_mean']:.3f} (step {evals[-1]['step']})",
        )
    table.add_row("report", str(report_dir))
    console.print(table)
    console.print("plots: " + ", ".join(p.name for p in written if p.suffix == ".png"))


def _validate(args: argparse.Namespace) -> int:
    job = load_rljob(args.job)
    problems = cluster_problems(job.spec) if args.cluster else []
    if problems:
        raise RLJobConfigError(f"{args.job}: a cluster cannot run this RLJob:\n" + "\n".join(problems))
    r = job.spec.rollout
    console.print(
        f"[green]ok[/]: RLJob {job.metadata.name}: {r.strategy} rollout on {r.engine} engine, "
        f"{r.rollout_batch_size} groups × {r.samples_per_prompt} samples, {job.spec.trainer.steps} steps"
    )
    mode = args.data or ("none" if args.cluster else "sample")
    if mode == "none":
        return 0
    return _report_data_check(job, None if mode == "all" else args.data_rows, args.strict)


def _report_data_check(job: RLJob, limit: int | None, strict: bool) -> int:
    """Print what `rljob validate` found in the job's data; 1 when --strict and a row would be skipped."""
    from rljob.runtime.tasks.data_check import check_data

    try:
        found = check_data(job, limit)
    except ValueError as err:
        raise RLJobConfigError(str(err)) from None
    for note in found.notes:
        console.print(f"[yellow]note[/]: {escape(note)}", soft_wrap=True)
    if not found.skipped:
        console.print(f"[green]data ok[/]: {found.rows_read} rows read, {found.rows_rendered} rendered, none skipped")
        return 0
    table = Table(title=f"{len(found.skipped)} data rows the runtime would skip (it logs and counts them, and goes on)")
    table.add_column("reason")
    table.add_column("row and problem", overflow="fold")
    for row in found.skipped[:20]:
        table.add_row(row.reason, row.message)
    console.print(table)
    if len(found.skipped) > 20:
        console.print(f"... and {len(found.skipped) - 20} more: {found.by_reason}")
    return 1 if strict else 0


def _export(args: argparse.Namespace) -> int:
    from rljob.runtime.export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.dir, dtype=args.dtype, force=args.force, model=args.model)
    console.print(
        f"[green]exported[/] {result.checkpoint} (step {result.step}, policy version {result.policy_version}) "
        f"to [bold]{result.directory}[/] as {result.dtype} safetensors with config and tokenizer"
    )
    if not result.hf_tokenizer:
        console.print("[yellow]note[/]: the builtin character tokenizer is rljob's own; transformers and SGLang "
                      "load the weights and config, not that tokenizer")
    return 0


def _build_model(args: argparse.Namespace) -> int:
    from rljob.runtime.models.tiny import TinyModelRecipe, build_tiny_model
    from rljob.runtime.tasks.policy import TINY_ARCHITECTURES

    family = TINY_ARCHITECTURES[args.name]  # a family name TinyModelRecipe knows (tests/unit/test_hf_models.py)
    folder = build_tiny_model(args.dir, TinyModelRecipe(family=family, seed=args.seed))  # type: ignore[arg-type]
    console.print(f"[green]built[/] {args.name} (random weights, locally trained tokenizer) at [bold]{folder}[/]; "
                  f"use it with spec.model.path: {folder}")
    return 0


def _add_run(sub: Subparsers) -> None:
    """The `run` command: train a job on this machine."""
    run = sub.add_parser("run", help="run an RLJob locally", description=RUN_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("job", help="path of the RLJob YAML file")
    run.add_argument("--output", help="output folder for metrics.jsonl and the report (default: runs/<job name>)")
    run.add_argument("--steps", type=int, help="total training steps, overriding spec.trainer.steps")
    run.add_argument("--strategy", choices=["sync", "april", "async"], help="override spec.rollout.strategy")
    run.add_argument("--fresh", action="store_true",
                     help="start a new run from step 0: the previous run's checkpoints move to "
                     "<checkpoint dir>/previous-<time>/ and its metrics.jsonl aside, never resumed")
    run.add_argument("--checkpoint-dir", help="override spec.checkpoint.dir")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: off)")
    run.add_argument("--compare-rounds", type=int, default=0, metavar="K",
                     help="after training, run K rollout rounds each of sync and april on the trained policy "
                     "(same prompts and seeds) and print the throughput comparison (0: skip)")
    run.add_argument("--no-live", dest="live", action="store_false",
                     help="print one line per step instead of the live display (logs, CI, pods)")
    run.add_argument("--table-rows", type=int, default=12, help="steps shown in the live table")
    run.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="train on N ranks started by torch.distributed.run (CPU, or one GPU each with "
                     "trainer.device: cuda; docs/gpu.md): rank 0 runs the rollouts, every rank trains its share "
                     "under FSDP2 (default 1: one process, no process group)")
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="with --nproc: restart the whole group up to R times when a rank fails; it resumes from "
                     "the last checkpoint")
    run.set_defaults(func=_run_command)


def _add_report(sub: Subparsers) -> None:
    """The `report` command: rebuild a run's plots."""
    report = sub.add_parser("report", help="rebuild a run's plots and summary from its metrics.jsonl",
                            description="Rebuild RUN_DIR/report (plots, summary.json, summary.md) from "
                            "RUN_DIR/metrics.jsonl and eval.jsonl, e.g. after a crash or while a run goes on.")
    report.add_argument("run_dir", help="the folder `rljob run` wrote (its --output, default runs/<job name>)")
    report.set_defaults(func=_report)


def _add_validate(sub: Subparsers) -> None:
    """The `validate` command: check a job file (and its data)."""
    validate = sub.add_parser("validate", help="check an RLJob file and print what it would run")
    validate.add_argument("job", help="path of the RLJob YAML file")
    validate.add_argument(
        "--cluster", action="store_true",
        help="also reject what the operator cannot run (the CRD's cluster rules), e.g. a builtin model or a local "
        "model.path on GPU inference pools, a Hugging Face id with no cache claim or download, engines of another "
        "vendor in an NCCL weight group, or several trainer pods on a ReadWriteOnce checkpoint claim",
    )
    validate.add_argument(
        "--data", choices=["sample", "all", "none"], default=None,
        help="open the data and report rows the runtime would skip (unreadable, unrenderable, too long for the "
        "context): 'sample' renders the first --data-rows rows (default without --cluster), 'all' every row, "
        "'none' skips the check (default with --cluster, whose paths are the pods')",
    )
    validate.add_argument("--data-rows", type=int, default=1000, metavar="N",
                          help="rows rendered by --data sample (default 1000)")
    validate.add_argument("--strict", action="store_true", help="exit 1 when any data row would be skipped")
    validate.set_defaults(func=_validate)


def _add_export(sub: Subparsers) -> None:
    """The `export` command: a checkpoint as a Hugging Face folder."""
    export = sub.add_parser(
        "export", help="write a training checkpoint as a Hugging Face model folder (transformers, SGLang)",
        description="Write the policy of an rljob checkpoint as a Hugging Face model folder: safetensors "
        "weights, config.json, generation_config.json and the tokenizer of the job's model.",
    )
    export.add_argument("checkpoint", help="a checkpoint folder (step-N), its state.pt, a checkpoint dir (newest), or an "
                        "s3://bucket/prefix[/step-N] URI (store from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
    export.add_argument("dir", help="output folder (must be empty or absent unless --force)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], help="weight precision (default: as trained)")
    export.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    export.add_argument("--model", metavar="DIR",
                        help="base model folder (config, tokenizer) instead of the job's model source: needed for a "
                        "cluster checkpoint, whose job names the model's path inside the trainer pod")
    export.set_defaults(func=_export)


def _add_model(sub: Subparsers) -> None:
    """The `model build` command: the tiny random architectures."""
    model = sub.add_parser("model", help="model folders: build the tiny random architectures")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser(
        "build", help="write a tiny random Qwen3 / Llama 3 model folder (no download)",
        description="Write the folder behind model.builtin tiny-qwen3 / tiny-llama: random weights, a "
        "tokenizer trained locally with the tokenizers library, a chat template and generation config.",
    )
    build.add_argument("name", choices=["tiny-qwen3", "tiny-llama"])
    build.add_argument("dir", help="output folder")
    build.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    build.set_defaults(func=_build_model)


def build_parser() -> argparse.ArgumentParser:
    """The `rljob` argument parser (kept separate so tests and docs can inspect it)."""
    parser = argparse.ArgumentParser(
        prog="rljob", description="rljob: fast RL post-training of LLMs with APRIL partial rollouts."
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ERROR)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_report, _add_validate, _add_export, _add_model):
        add(sub)
    simulate = sub.add_parser("simulate", help="simulate rollout strategies on a GPU cluster (virtual time)")
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=run_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rljob` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc hands to torchrun
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    try:
        return int(args.func(args) or 0)
    except RLJobConfigError as err:
        # Unwrapped, so paths and field names can be copied; escaped, so `[0]` is not read as markup.
        console.print(f"[red]invalid RLJob[/]\n{escape(str(err))}", soft_wrap=True)
        return 2
    except EngineError as err:
        console.print(f"[red]engine error[/]: {escape(str(err))}", soft_wrap=True)
        return 3
    except RewardCollapse as err:
        from rljob.api.status import EXIT_REWARD_COLLAPSE, REWARD_COLLAPSE_REASON

        return _terminate(f"{REWARD_COLLAPSE_REASON}: {err}", EXIT_REWARD_COLLAPSE)
    except (ModelSourceError, ExportError) as err:
        console.print(f"[red]error[/]: {escape(str(err))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; the last checkpoint is kept, run the same command to resume")
        return 130


if __name__ == "__main__":
    sys.exit(main())
