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
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rljob.operator.builders import network

if TYPE_CHECKING:
    from rljob.operator.leader import LeaderElector

log = logging.getLogger("rljob.operator")


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


class _StandbyHealth(BaseHTTPRequestHandler):
    """200 on every path: a standby replica waiting for the Lease is alive (kopf's endpoint starts with it)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"standby": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


def standby_liveness(url: str) -> ThreadingHTTPServer | None:
    """Serve the liveness URL while waiting for leadership; None when liveness is off."""
    if not url:
        return None
    parts = urlsplit(url)
    server = ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 8081), _StandbyHealth)
    threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True).start()
    return server


def lead_or_wait(args: argparse.Namespace, identity: str) -> LeaderElector:
    """With --leader-elect: block until this replica holds the Lease, then keep renewing it.

    Returns the elector (to release the Lease at shutdown). A leader that has not renewed within the
    renew deadline exits with status 1 at once, before any standby may take the Lease, so two replicas
    never reconcile together. Exiting, not stepping down in process: kopf runs handlers on many
    threads (children applied concurrently) with no way to stop them between two writes, and
    `os._exit` ends them all at once; the Deployment restarts the pod as a standby.
    """
    from rljob.common.kube import Kube, load_api_client
    from rljob.operator.leader import LeaderElector, LeaseTiming

    try:
        timing = LeaseTiming.derived(
            lease_s=args.lease_seconds, renew_s=args.renew_seconds, renew_deadline_s=args.renew_deadline_seconds
        )
    except ValueError as err:
        raise SystemExit(f"--lease-seconds/--renew-deadline-seconds/--renew-seconds: {err}") from err
    elector = LeaderElector(
        Kube(load_api_client()),
        namespace=args.leader_election_namespace,
        name=args.leader_election_id,
        identity=identity,
        timing=timing,
        retry_s=min(2.0, args.renew_seconds),
    )
    health = standby_liveness(args.liveness)
    elector.acquire()
    if health is not None:
        health.shutdown()
        health.server_close()

    def lost() -> None:
        log.error("leadership lost: exiting so that only one replica reconciles")
        os._exit(1)

    elector.keep_renewing(lost, threading.Event())
    return elector


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
    parser.add_argument(
        "--apply-concurrency", type=int, default=8, help="children of one RLJob applied at once (1: one by one)"
    )
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    parser.add_argument("--leader-election-id", default="rljob-operator", help="name of the Lease")
    parser.add_argument("--lease-seconds", type=int, default=15, help="a leader silent this long is replaced")
    parser.add_argument("--renew-seconds", type=float, default=2.0, help="how often the leader renews the Lease")
    parser.add_argument(
        "--renew-deadline-seconds",
        type=float,
        default=None,
        help="a leader that has not renewed for this long exits (default: 2/3 of --lease-seconds)",
    )
    parser.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="give every RLJob NetworkPolicies guarding its pods (default: on; $RLJOB_NETWORK_POLICY)",
    )
    parser.add_argument(
        "--monitoring-namespace",
        default=None,
        help="namespace whose pods may scrape the jobs' metrics ports (default: none; $RLJOB_MONITORING_NAMESPACE)",
    )
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
    os.environ["RLJOB_APPLY_CONCURRENCY"] = str(args.apply_concurrency)
    if args.network_policy is not None:
        os.environ[network.ENV_ENABLED] = str(args.network_policy).lower()
    if args.monitoring_namespace is not None:
        os.environ[network.ENV_MONITORING_NAMESPACE] = args.monitoring_namespace
    importlib.import_module("rljob.operator.handlers")

    import kopf

    identity = peering_identity()
    elector = lead_or_wait(args, identity) if args.leader_elect else None
    try:
        # standalone: kopf's own peering is not needed, the Lease decides who runs.
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness or None,
            identity=identity,
        )
    finally:
        if elector is not None:
            elector.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
