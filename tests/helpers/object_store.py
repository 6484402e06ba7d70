"""A real S3-compatible object store on loopback: SeaweedFS's `weed server -s3`, with credentials.

The binary is built once by `tests/cluster/localkube.sh build` (cached by version, like the cluster's
binaries); this module only starts a server in a temp folder, makes a bucket and stops it again.
Requests must be signed with the keys it yields: the server is started with an identity list, so an
unsigned or wrongly signed request is refused as a real store would refuse it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.binaries import BinariesUnavailable, binary_path, ensure_built
from tests.helpers.processes import free_port, spawn, stop, wait_http

BUCKET = "rljob-test"
# SeaweedFS answers S3 within ~15 s on an idle machine; the shared 2-core box can be much slower.
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class S3Server:
    """Where a running test store answers and the keys it accepts."""

    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (and the runtime) at this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }


def s3_identities(access_key: str, secret_key: str) -> dict[str, object]:
    """SeaweedFS's -s3.config: one identity with full rights on every bucket."""
    return {
        "identities": [
            {
                "name": "rljob-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


def _create_bucket(weed: Path, master: str, bucket: str, log: Path, deadline: float) -> None:
    """`s3.bucket.create` through `weed shell`: the admin path, so the test needs no S3 client of its own.
    Retried until `deadline` (monotonic): the filer the shell needs may register after the gateway answers."""
    while True:
        proc = subprocess.run(
            [str(weed), f"-logdir={log.parent}", "shell", f"-master={master}"],
            input=f"s3.bucket.create -name {bucket}\n",
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        with log.open("a") as out:
            out.write(proc.stdout + proc.stderr)
        # The shell exits 0 after a command error too: success is its own report.
        if proc.returncode == 0 and f"created bucket {bucket}" in proc.stdout:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"weed shell s3.bucket.create failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
            )
        time.sleep(1.0)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on loopback with one bucket, for the session; stopped at the end."""
    try:
        ensure_built(("weed",))
    except BinariesUnavailable as err:
        pytest.fail(str(err))
    weed = binary_path("weed")
    root = tmp_path_factory.mktemp("seaweedfs")
    data = root / "data"
    data.mkdir()
    access_key, secret_key = secrets.token_hex(8), secrets.token_hex(20)
    config = root / "s3.json"
    config.write_text(json.dumps(s3_identities(access_key, secret_key)))
    # Every port explicit: SeaweedFS otherwise puts each gRPC port at its HTTP port + 10000.
    s3, master, volume, filer, *grpc = (free_port() for _ in range(8))
    log = root / "weed.log"
    proc = spawn(
        [
            # -logdir: glog's files (three per start) go beside the data instead of piling up in /tmp.
            str(weed), f"-logdir={root}", "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-s3", f"-s3.port={s3}",
            f"-master.port.grpc={grpc[0]}", f"-volume.port.grpc={grpc[1]}", f"-filer.port.grpc={grpc[2]}",
            f"-s3.port.grpc={grpc[3]}", f"-s3.config={config}",
            # Small volumes, a fixed count: `-volume.max=0` divides the free disk by the 30 GB default
            # volume size, which on a disk with ~46 GB free left one volume, taken by the first
            # collection, and every PUT into the bucket's collection then failed with 500.
            "-master.volumeSizeLimitMB=256", "-volume.max=64",
        ],
        log,
    )
    try:
        endpoint = f"http://127.0.0.1:{s3}"
        # The S3 gateway answers its health check only once the filer behind it is up.
        deadline = time.monotonic() + START_TIMEOUT_S
        wait_http(f"{endpoint}/healthz", START_TIMEOUT_S, proc, log)
        # host:port.grpcPort: SeaweedFS's address form for a gRPC port that is not port + 10000.
        _create_bucket(weed, f"127.0.0.1:{master}.{grpc[0]}", BUCKET, log, deadline)
        yield S3Server(endpoint, BUCKET, access_key, secret_key)
    finally:
        stop([proc])
