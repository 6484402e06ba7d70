"""S3-compatible object storage (AWS S3, MinIO, SeaweedFS, Ceph RGW...) for checkpoints and models: URIs,
folders of objects.

Only the storage I/O lives here; what a checkpoint is, and when one counts as complete, is
`rljob.runtime.checkpoint`'s business, and fetching a model folder `rljob.runtime.models.object_source`'s. The client is obstore (Apache Arrow's Rust `object_store`):
it signs requests, and retries connection errors, timeouts and 5xx answers with exponential backoff
and jitter up to `retry_timeout_s`; past that an `ObjectStoreError` names the URI, the endpoint and
what to check.

Connection settings come, in this order, from the arguments (the spec's `checkpoint.s3` or `model.s3`) and from the
standard AWS environment: AWS_ENDPOINT_URL (MinIO, SeaweedFS...), AWS_REGION, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (on a cluster the operator fills the keys from a Secret).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

S3_SCHEME = "s3://"
# The region signed requests name when nothing sets one: S3-compatible stores accept any, AWS's default.
DEFAULT_REGION = "us-east-1"


class ObjectStoreError(RuntimeError):
    """The store could not be reached or refused a request; the message says which and what to check."""


def is_object_uri(uri: str) -> bool:
    """Whether `uri` names an object store location (s3://) rather than a folder."""
    return uri.startswith(S3_SCHEME)


@dataclass(frozen=True)
class ObjectUri:
    """`s3://bucket/prefix`: a bucket and a folder-like key prefix inside it ('' for the bucket's root)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str, field: str = "checkpoint.uri") -> ObjectUri:
        """Split `uri`; a ValueError names `field` when it is not s3://bucket[/prefix]."""
        if not is_object_uri(uri):
            raise ValueError(f"{field}: {uri!r} is not an s3://bucket/prefix URI")
        bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
        if not bucket:
            raise ValueError(f"{field}: {uri!r} names no bucket; write s3://BUCKET/PREFIX")
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"{field}: {uri!r} has a '.' or '..' segment; object keys are not paths")
        return cls(bucket, "/".join(parts))

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"

    def child(self, name: str) -> str:
        """The URI of the folder `name` under this prefix."""
        return f"{self}/{name}"


@dataclass(frozen=True)
class StoreSettings:
    """How to reach the store; None: the AWS environment's value (AWS_ENDPOINT_URL, AWS_REGION)."""

    endpoint: str | None = None
    region: str | None = None
    retry_timeout_s: float = 300.0


class ObjectStore:
    """Folders of objects under one `s3://bucket/prefix`: list, upload, download, delete.

    `field`: the spec section the store belongs to (`checkpoint` or `model`), named in errors."""

    def __init__(self, uri: ObjectUri, settings: StoreSettings | None = None, field: str = "checkpoint") -> None:
        self.uri = uri
        self.field = field
        settings = settings or StoreSettings()
        self.endpoint = settings.endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        region = settings.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        client: ClientConfig = {"connect_timeout": timedelta(seconds=10), "timeout": timedelta(minutes=10)}
        if self.endpoint is not None and self.endpoint.startswith("http://"):
            client["allow_http"] = True  # an in-cluster MinIO or SeaweedFS without TLS
        retry: RetryConfig = {"max_retries": 10, "retry_timeout": timedelta(seconds=settings.retry_timeout_s)}
        extra = {"endpoint": self.endpoint} if self.endpoint is not None else {}
        # Path-style addressing (virtual_hosted_style_request off, obstore's default) is what MinIO and
        # SeaweedFS expect on a plain endpoint.
        self._store = S3Store(
            uri.bucket,
            prefix=uri.prefix or None,
            region=region or DEFAULT_REGION,
            client_options=client,
            retry_config=retry,
            **extra,  # type: ignore[arg-type]
        )

    def _error(self, action: str, err: BaseError) -> ObjectStoreError:
        where = f" at {self.endpoint}" if self.endpoint else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ObjectStoreError(
            f"{self.field}.uri: could not {action} {self.uri}{where}: {first[:400]}. Check that the store is "
            f"reachable ({self.field}.s3.endpoint or AWS_ENDPOINT_URL), that the bucket exists, and that "
            f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY ({self.field}.s3.credentialsSecret on a cluster) may use it."
        )

    def folders(self) -> dict[str, set[str]]:
        """The folders directly under the prefix that hold at least one object, each with its keys
        (relative to the folder). One listing, derived from the keys rather than the delimiter listing:
        SeaweedFS, like a filesystem, lists a folder whose objects were all deleted until it reaps it."""
        try:
            keys = [meta["path"] for batch in obstore.list(self._store) for meta in batch]
        except BaseError as err:
            raise self._error("list", err) from err
        found: dict[str, set[str]] = {}
        for key in keys:
            folder, sep, rest = key.partition("/")
            if sep:
                found.setdefault(folder, set()).add(rest)
        return found

    def exists(self, key: str) -> bool:
        """Whether the object `key` (relative to the prefix) exists."""
        try:
            obstore.head(self._store, key)
        except (NotFoundError, FileNotFoundError):  # obstore raises the builtin for a 404
            return False
        except BaseError as err:
            raise self._error(f"read {key} in", err) from err
        return True

    def keys(self, folder: str) -> list[str]:
        """Every object key under `folder`, relative to the prefix."""
        return list(self.objects(folder))

    def objects(self, folder: str) -> dict[str, str]:
        """Every object under `folder`: key (relative to the prefix) -> its version as `size:ETag`, which
        changes whenever the object is rewritten (a local copy compares it to know it is current)."""
        try:
            return {meta["path"]: f"{meta['size']}:{meta['e_tag']}"
                    for batch in obstore.list(self._store, f"{folder}/") for meta in batch}
        except BaseError as err:
            raise self._error(f"list {folder} in", err) from err

    def put_file(self, local: Path, key: str) -> None:
        """Upload the file `local` as `key` (multipart for large files)."""
        try:
            obstore.put(self._store, key, local)
        except BaseError as err:
            raise self._error(f"write {key} to", err) from err

    def upload_folder(self, local: Path, folder: str, last: str | None = None) -> None:
        """Upload every file under `local` into `folder`; the file named `last` (relative to `local`)
        goes after all the others, so a reader that sees it knows the rest is there."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        tail = [local / last] if last is not None else []
        for path in [p for p in files if p not in tail] + tail:
            self.put_file(path, f"{folder}/{path.relative_to(local).as_posix()}")

    def download_folder(self, folder: str, local: Path, select: Callable[[str], bool] | None = None) -> None:
        """Replace `local` with a copy of `folder` (only the files whose path in it `select` accepts, when
        given): written beside it, then renamed into place, so an interrupted download never leaves a
        folder that looks whole."""
        staging = local.with_name(f".download-{local.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for key in self.keys(folder):
            relative = PurePosixPath(key).relative_to(folder)
            if select is not None and not select(relative.as_posix()):
                continue
            target = staging / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with target.open("wb") as out:
                    for chunk in obstore.get(self._store, key):
                        out.write(chunk)
            except BaseError as err:
                raise self._error(f"read {key} from", err) from err
        shutil.rmtree(local, ignore_errors=True)
        staging.rename(local)

    def delete_folder(self, folder: str) -> None:
        """Delete every object under `folder`."""
        keys = self.keys(folder)
        try:
            obstore.delete(self._store, keys)
        except BaseError as err:
            raise self._error(f"delete {folder} in", err) from err
