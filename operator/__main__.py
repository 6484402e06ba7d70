"""`python -m rljob.operator`: run the RLJob operator (kopf) with metrics and a liveness endpoint."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse flags, export them for the handlers module, and run kopf until stopped."""
    parser = argparse.ArgumentParser(prog="python -m rljob.operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster (default)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL")
    parser.add_argument("--metrics-port", type=int, default=8080, help="operator /metrics port (0 disables)")
    parser.add_argument("--metrics-addr", default="0.0.0.0")
    parser.add_argument("--resync-seconds", type=float, default=10.0, help="status resync period")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)

    # `kill -USR1 <pid>` dumps every thread's stack: the way to see what a stuck reconcile waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The handlers module reads these at import time (timer interval), as under `kopf run -m`.
    os.environ["RLJOB_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["RLJOB_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    os.environ["RLJOB_OPERATOR_METRICS_ADDR"] = args.metrics_addr
    importlib.import_module("rljob.operator.handlers")

    import kopf

    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
