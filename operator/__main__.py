"""`python -m rljob.operator`: run the RLJob operator (kopf) with metrics and a liveness endpoint."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import getpass
import importlib
import logging
import os
import random
import signal
import socket
import string
import sys


def peering_identity() -> str:
    """This operator's kopf identity, `<user>@<host>/<time>/<random>` as kopf builds it.

    kopf derives it from `getpass.getuser()`, which raises `KeyError: 'getpwuid(): uid not found'`
    when the process runs as a uid without a passwd entry and no USER/LOGNAME variable: exactly the
    chart's pod (uid 65532 on a stock base image, or any uid an admission policy assigns). The uid
    number stands in for the missing name. kopf's own `POD_ID` variable still wins when set.
    """
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid-{os.getuid()}"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=3))
    return f"{user}@{socket.gethostname()}/{now}/{suffix}"


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
    os.environ["RLJOB_WATCH_NAMESPACES"] = ",".join(args.namespace)
    importlib.import_module("rljob.operator.handlers")

    import kopf

    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        identity=peering_identity(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
