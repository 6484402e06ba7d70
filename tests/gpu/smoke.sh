#!/usr/bin/env bash
# GPU smoke check (tests/gpu/smoke.py): bf16 FSDP2 step, embedded engine decode, trainer/engine log-prob
# agreement and the weight-update group's path, on one GPU, with a tiny Qwen3 built here (no network).
#
#   bash tests/gpu/smoke.sh                 # on the GPU (CUDA; NCCL for the process groups)
#   bash tests/gpu/smoke.sh --device cpu    # the same on CPU (gloo), as the tests run it
#
# Needs python with torch; rljob is imported from this checkout (no install). When transformers,
# tokenizers, safetensors or pydantic are missing (a bare machine with PyTorch only), they are
# installed offline from $RLJOB_SMOKE_WHEELS (default tests/gpu/wheels, git-ignored, about 46 MB, filled by
# `PYTHON_VERSION=311 bash tests/gpu/smoke.sh --fetch-wheels` on a machine with a package index, for the
# target's Python). Exits non-zero on any failure;
# gives up after $RLJOB_SMOKE_TIMEOUT seconds (default 480: the 8 minutes it is sized for).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
WHEELS=${RLJOB_SMOKE_WHEELS:-$REPO/tests/gpu/wheels}
NEEDED=(transformers tokenizers safetensors pydantic huggingface_hub)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  # The versions the tests run with (images/runtime-requirements.txt), without torch, for the target's Python
  # (PYTHON_VERSION, default this one's). Kept under the 64 MiB a device run may carry.
  shift
  pyver=${PYTHON_VERSION:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}
  mkdir -p "$WHEELS"
  grep -iE '^(transformers|tokenizers|safetensors|pydantic|pydantic_core|pydantic-core|annotated-types|typing_extensions|typing-inspection|huggingface_hub|hf-xet|filelock|fsspec|packaging|pyyaml|PyYAML|regex|requests|tqdm|numpy|jinja2|Jinja2|MarkupSafe|markupsafe|urllib3|idna|certifi|charset-normalizer|httpx|httpcore|h11|anyio|sniffio|typer|click|shellingham|rich|markdown-it-py|mdurl|pygments|annotated-doc)==' \
    images/runtime-requirements.txt > "$WHEELS/requirements.txt"
  "$PYTHON" -m pip download --only-binary=:all: --no-deps --python-version "$pyver" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$WHEELS" -r "$WHEELS/requirements.txt"
  du -sh "$WHEELS"
  exit 0
fi

# rljob is a namespace of the top-level folders (setup.py): map them without installing anything.
NS=$(mktemp -d)
trap 'rm -rf "$NS"' EXIT
mkdir -p "$NS/rljob"
for top in api common runtime; do ln -s "$REPO/$top" "$NS/rljob/$top"; done
export PYTHONPATH="$NS:$REPO${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "smoke: rljob needs Python 3.11 or newer; $PYTHON is $("$PYTHON" -V 2>&1)" >&2
  exit 2
fi
missing=()
for module in torch "${NEEDED[@]}"; do
  "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module")
done
if ((${#missing[@]})); then
  if [[ " ${missing[*]} " == *" torch "* ]]; then
    echo "smoke: $PYTHON has no torch; nothing to check" >&2
    exit 2
  fi
  if [[ ! -d "$WHEELS" ]]; then
    echo "smoke: missing ${missing[*]} and no wheels in $WHEELS (fill it with: bash tests/gpu/smoke.sh --fetch-wheels)" >&2
    exit 2
  fi
  # Only what is missing (with what it needs and lacks): the machine's own torch and its dependencies stay.
  echo "smoke: installing ${missing[*]} offline from $WHEELS"
  "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
fi

export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# Not `exec`: the shell must live on for its EXIT trap to remove $NS (an exec left one folder per run in /tmp).
status=0
timeout --kill-after=10 "${RLJOB_SMOKE_TIMEOUT:-480}" "$PYTHON" tests/gpu/smoke.py "$@" || status=$?
exit "$status"
