"""`rljob run JOB`: train a job on this machine, in one process or on --nproc ranks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.live import Live

from rljob.api import load_rljob
from rljob.api.spec import RLJob
from rljob.runtime.cli.console import Subparsers, console, terminate
from rljob.runtime.cli.launch import launch_ranks
from rljob.runtime.cli.rebuild_report import read_run, rebuild_report
from rljob.runtime.cli.views import RunDisplay, comparison_view, print_summary, step_line
from rljob.runtime.step_record import StepRecord

if TYPE_CHECKING:
    from rljob.runtime.runner import JobRunner
    from rljob.runtime.training.distributed import Distributed

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


def run_command(args: argparse.Namespace) -> int:
    """`rljob run`: start N ranks through torchrun, or run this process's rank (or the only one)."""
    from rljob.runtime.training.distributed import DistEnv, Distributed

    env = DistEnv.from_environ()
    if args.nproc < 1:
        raise SystemExit("rljob run: --nproc must be >= 1")
    if args.nproc > 1 and env is None:
        if args.compare_rounds:
            raise SystemExit("rljob run: --compare-rounds runs in a single process; drop --nproc or --compare-rounds")
        return launch_ranks(args)
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

        rank = TrainingRank(job, distributed)
        rank.run()
        # Stopped by the group's SIGTERM vote: Interrupted, as rank 0, so that this rank's pod (its own
        # termination message) reads as a disruption to the operator, not a failure nor a success.
        return _interrupted(rank.checkpointed_step) if rank.interrupted else 0
    finally:
        distributed.close()


def is_rank_process(args: argparse.Namespace) -> bool:
    """Whether this process is one rank of a multi-rank `rljob run` (torchrun set WORLD_SIZE > 1)."""
    from rljob.runtime.training.distributed import DistEnv

    if args.func is not run_command:
        return False
    try:
        return DistEnv.from_environ() is not None
    except ValueError:
        return False


def end_rank_process(code: int) -> NoReturn:
    """Exit a rank's process with `code`, skipping the interpreter's teardown.

    By then the rank's work is done: its groups are destroyed, checkpoints and (rank 0) the report
    written, every file closed. What is left is the teardown, where torch objects the FSDP model still
    holds (its gloo groups' backends, their threads) are destroyed while the interpreter finalizes. A
    rank died there now and then: SIGABRT, "terminate called without an active exception", and no
    Python frame in faulthandler's dump, after its last step (a resumed 2-rank run in clean-clone run 31;
    most likely the restarted gang's rank 1 of CI's stop 36 too). torchrun then fails the group, and a
    finished job reads as a failed gang. The buffered output goes first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _print_start(runner: JobRunner) -> None:
    """What the set-up found: the checkpoint resumed from, newer ones passed over, the metrics endpoint."""
    if runner.resumed_from:
        console.print(f"resumed from [bold]{runner.resumed_from}[/] at step {runner.step}")
    for skipped in runner.skipped_checkpoints:
        console.print(f"[yellow]skipped the newer checkpoint {skipped}[/]")
    if runner.metrics_port:
        console.print(f"metrics on http://{runner.settings.metrics_host}:{runner.metrics_port}/metrics")


async def _run(args: argparse.Namespace, job: RLJob, distributed: Distributed | None) -> int:
    """This process's run (the only one, or rank 0): set up, the steps with their display, the comparison
    (--compare-rounds) and the report."""
    from rljob.runtime.compare import compare_strategies
    from rljob.runtime.knob_sources import knob_sources_for
    from rljob.runtime.report import write_report
    from rljob.runtime.runner import JobRunner, RunOptions

    output = Path(args.output or Path("runs") / job.metadata.name)
    # torchrun restarting a failed group: resume from the last checkpoint, never start over.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0") > 0
    fresh = args.fresh and not restarted
    options = RunOptions(output_dir=output, steps=args.steps, strategy=args.strategy,
                         resume=False if fresh else None, metrics_port=args.metrics_port)
    runner = JobRunner(job, options, distributed)
    runner.knob_sources.extend(knob_sources_for(job.spec, runner.step_listeners))
    if fresh:
        _start_fresh(runner)
    # Plain status lines, not a spinner: the policy warm-up shows its own progress bar, and rich
    # allows one live display at a time.
    await runner.setup(on_status=lambda msg: console.print(f"[bold]{msg}[/] …"))
    _print_start(runner)

    display = RunDisplay(runner, job.spec.rollout.rollout_batch_size, args.table_rows)

    band = (job.spec.autotune.truncation_band.low, job.spec.autotune.truncation_band.high)

    def on_step(rec: StepRecord) -> None:
        display.add_step(rec)
        if rec.step % job.spec.checkpoint.every_steps == 0:  # a crashed run keeps plots up to its last checkpoint
            rebuild_report(output, band)
        if not args.live:
            console.print(step_line(rec))

    if args.live:
        with Live(display.render(), console=console, refresh_per_second=4, get_renderable=display.render):
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

    history, evals = read_run(runner.metrics.jsonl_path)
    written = write_report(output / "report", history, comparison, evals, band)
    print_summary(summary, history, evals, output / "report", written)
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


def _interrupted(step: int) -> int:
    """SIGTERM before the last step: say so (termination message, for the operator) and exit EXIT_INTERRUPTED.

    Never 0: a drained or evicted trainer is not a finished one.
    """
    from rljob.api.status import EXIT_INTERRUPTED, INTERRUPTED_REASON

    return terminate(f"{INTERRUPTED_REASON}: SIGTERM after step {step}; its checkpoint is written, the next run "
                     "resumes there", EXIT_INTERRUPTED)


def add_parser(sub: Subparsers) -> None:
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
    run.set_defaults(func=run_command)
