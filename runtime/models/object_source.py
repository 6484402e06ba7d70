"""A model folder in an S3-compatible object store (`model.uri: s3://bucket/folder`), copied to local disk.

A cluster without egress keeps its weights in its own bucket (MinIO, SeaweedFS, Ceph RGW...). On a
cluster the operator runs `python -m rljob.runtime.models.object_source URI DEST` in an init container
of every pod that loads the model (credentials from `model.s3.credentialsSecret`, as the standard AWS
variables); `rljob run` fetches into `$RLJOB_CACHE/models/s3/<bucket>/<folder>` and loads from there.

A copy is current when the store lists the same objects at the same versions (size and ETag) as when it
was downloaded: the listing is kept beside the folder, so a second run downloads nothing, and a model
rewritten in the bucket is downloaded again. Ranks of one machine take a file lock, so one downloads
and the others find the copy current.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from filelock import FileLock

from rljob.api.spec import ModelS3Spec
from rljob.runtime.models.errors import ModelSourceError
from rljob.runtime.object_store import ObjectStore, ObjectStoreError, ObjectUri, StoreSettings

log = logging.getLogger(__name__)

FIELD = "spec.model.uri"
# Files of the weights themselves (and their shard indexes), left out of a copy made only to read the
# config and the tokenizer.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf")


def local_copy_dir(uri: str, cache: Path, weights: bool = True) -> Path:
    """Where `rljob run` keeps the copy of `uri` under the rljob cache `cache` (`weights` False: the
    config-and-tokenizer copy `rljob validate` reads, kept apart so it never passes for a whole model)."""
    parsed = ObjectUri.parse(uri, FIELD)
    return cache / "models" / ("s3" if weights else "s3-meta") / parsed.bucket / parsed.prefix


def _listing_file(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.objects.json")


def _store_and_folder(uri: str, settings: StoreSettings) -> tuple[ObjectStore, str]:
    """The store rooted at the folder's parent, and the folder's name: the store's unit is a folder."""
    parsed = ObjectUri.parse(uri, FIELD)
    if not parsed.prefix:
        raise ModelSourceError(f"{FIELD}: {uri!r} names a bucket; write s3://BUCKET/FOLDER, the folder holding the model")
    parent, _, name = parsed.prefix.rpartition("/")
    return ObjectStore(ObjectUri(parsed.bucket, parent), settings, field="model"), name


def fetch_model(uri: str, dest: Path, settings: StoreSettings | None = None, weights: bool = True) -> Path:
    """Make `dest` a current copy of the model folder `uri` (without its weight files when not
    `weights`: config and tokenizer, what `rljob validate` reads); returns `dest`.

    Raises ModelSourceError naming spec.model.uri when the folder holds no objects or no config.json,
    or naming model.uri, the endpoint and what to check when the store cannot be used (an
    ObjectStoreError, re-raised as the model error the CLI reports without a traceback)."""
    try:
        return _fetch(uri, dest, settings or StoreSettings(), weights)
    except ObjectStoreError as err:
        raise ModelSourceError(str(err)) from err


def _fetch(uri: str, dest: Path, settings: StoreSettings, weights: bool) -> Path:
    store, folder = _store_and_folder(uri, settings)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.with_name(f"{dest.name}.lock"))):
        objects = store.objects(folder)
        if not objects:
            raise ModelSourceError(
                f"{FIELD}: {uri} holds no objects; upload the model folder (config.json, weights, tokenizer) there "
                f"first, e.g. `aws s3 cp --recursive MODEL_DIR {uri}/` (with --endpoint-url for MinIO or SeaweedFS)"
            )
        if f"{folder}/config.json" not in objects:
            raise ModelSourceError(
                f"{FIELD}: {uri} has no config.json; it must name the folder save_pretrained wrote "
                f"(found {', '.join(sorted(objects)[:5])}{', ...' if len(objects) > 5 else ''})"
            )
        if not weights:
            objects = {k: v for k, v in objects.items() if not _is_weights(k)}
        listing = _listing_file(dest)
        if dest.is_dir() and listing.is_file() and json.loads(listing.read_text()) == objects:
            log.info("model %s: the copy in %s is current", uri, dest)
            return dest
        log.info("model %s: downloading %d objects into %s", uri, len(objects), dest)
        listing.unlink(missing_ok=True)  # a crash from here on leaves no listing: the next run downloads again
        store.download_folder(folder, dest, None if weights else lambda name: not _is_weights(name))
        listing.write_text(json.dumps(objects, sort_keys=True))
    return dest


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def store_settings(s3: ModelS3Spec | None) -> StoreSettings:
    """The connection settings of `model.s3` (the environment's where unset)."""
    return StoreSettings() if s3 is None else StoreSettings(endpoint=s3.endpoint, region=s3.region)


def main(argv: list[str] | None = None) -> None:
    """The cluster's model-download step: `python -m rljob.runtime.models.object_source URI DEST`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("uri", help="s3://BUCKET/FOLDER")
    parser.add_argument("dest", type=Path, help="local folder to copy it into")
    parser.add_argument("--endpoint", default=None, help="S3 API base URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--region", default=None, help="signing region (default: AWS_REGION, else us-east-1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        fetch_model(args.uri, args.dest, StoreSettings(endpoint=args.endpoint, region=args.region))
    except ModelSourceError as err:
        sys.exit(str(err))  # the pod's termination message (FallbackToLogsOnError) is this line


if __name__ == "__main__":
    main()
