"""`rljob run --nproc N`: the same command line on N local ranks, started by torch.distributed.run."""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import uuid

from rich.markup import escape

from rljob.runtime.cli.console import console


def launch_ranks(args: argparse.Namespace) -> int:
    """Run this same command line on --nproc local ranks through torch.distributed.run's launcher API
    (as `torchrun --nnodes 1 --master-addr 127.0.0.1 --master-port P`); 0 when every rank succeeded.

    The static rendezvous, not `--standalone`'s c10d one: with torch 2.13 a group restarted after a
    failed rank (--max-restarts) hangs in init_process_group under the c10d rendezvous, and restarts
    cleanly under the static one."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from rljob.api.status import EXIT_INTERRUPTED

    with socket.socket() as probe:  # a free port for the agent's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The agent's per-rank log folders (error records) in a folder removed when the launch ends: by
    # default torch makes them in a new torchelastic_* folder under /tmp that nothing removes, one per run
    # (a failure to remove it must not fail a run that succeeded).
    with tempfile.TemporaryDirectory(prefix="rljob-ranks-", ignore_cleanup_errors=True) as logs:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()), rdzv_backend="static",
            rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, max_restarts=args.max_restarts,
            monitor_interval=1.0, logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        # Each rank runs `rljob run ...` again and, seeing WORLD_SIZE, joins the group instead of launching.
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "rljob.runtime.cli", *args.argv)
        except SignalException as err:
            # SIGTERM to the launcher (as to torchrun, process 1 of a trainer pod): it forwarded the signal
            # to every rank and waited up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT for them to checkpoint and exit.
            console.print(f"stopped by signal {err.sigval.name}; run the same command to resume from the last "
                          "checkpoint", soft_wrap=True)
            return EXIT_INTERRUPTED
        except ChildFailedError as err:
            if all(f.exitcode == EXIT_INTERRUPTED for f in err.failures.values()):
                return EXIT_INTERRUPTED  # a rank got SIGTERM: the group checkpointed and stopped together
            console.print(f"[red]rank failed[/] ({args.max_restarts} restarts allowed): {escape(str(err))}",
                          soft_wrap=True)
            return 1
    return 0
