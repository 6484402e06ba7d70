#!/usr/bin/env bash
# Local Kubernetes control plane, helm and Prometheus for rljob's tests and local development.
#
#   localkube.sh build                 build or reuse every binary (cached by version, outside the repo)
#   localkube.sh up [--foreground] [localkube up flags, e.g. --nvidia-nodes 4 --amd-nodes 0]
#   localkube.sh down | status | env   stop / report / print `export KUBECONFIG=...`
#   localkube.sh path NAME             path of localkube|kwok|kwokstages|helm|promtool|prometheus
#   localkube.sh helm|promtool|prometheus   shorthand for `path NAME`
#
# Environment: RLJOB_CACHE (binary cache root, default ~/.cache/rljob), LOCALKUBE_DIR (state of
# the running plane, default <repo>/.cache/localkube).
set -euo pipefail

K8S_VERSION=v1.36.3
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${RLJOB_CACHE:-$HOME/.cache/rljob}"
BIN="$CACHE/bin"
STATE="${LOCALKUBE_DIR:-$REPO/.cache/localkube}"

die() { echo "localkube.sh: $*" >&2; exit 1; }
note() { echo "localkube.sh: $*" >&2; }

# Cache keys: a version, plus a hash of our own sources where we compile them, so an edit to the
# supervisor or a go.mod bump rebuilds and everything else is reused.
src_hash() { (cd "$1" && cat go.mod go.sum ./*.go) | sha256sum | cut -c1-12; }
localkube_dir() { echo "$BIN/localkube-$K8S_VERSION-$(src_hash "$HERE/localkube")"; }
kwokstages_dir() { echo "$BIN/kwokstages-$KWOK_VERSION-$(src_hash "$HERE/kwokstages")"; }
kwok_dir() { echo "$BIN/kwok-$KWOK_VERSION"; }
helm_dir() { echo "$BIN/helm-$HELM_VERSION"; }
# The Debian version is only known after download, so the newest extracted one is used.
prometheus_dir() { find "$BIN" -maxdepth 1 -type d -name 'prometheus-*' 2>/dev/null | sort -V | tail -n 1; }

path_of() {
  case "$1" in
    localkube) echo "$(localkube_dir)/localkube" ;;
    kwokstages) echo "$(kwokstages_dir)/kwokstages" ;;
    kwok) echo "$(kwok_dir)/kwok" ;;
    helm) echo "$(helm_dir)/helm" ;;
    promtool | prometheus) local d; d="$(prometheus_dir)"; echo "${d:-$BIN/prometheus-MISSING}/usr/bin/$1" ;;
    *) die "unknown binary '$1' (localkube|kwok|kwokstages|helm|promtool|prometheus)" ;;
  esac
}

ALL=(localkube kwokstages kwok helm promtool prometheus)

missing() {
  local name
  for name in "${ALL[@]}"; do [[ -x "$(path_of "$name")" ]] || echo "$name"; done
}

go_env() {
  command -v go >/dev/null || die "Go is not installed; install Go >= 1.26 (the Kubernetes ${K8S_VERSION} module needs it)"
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-p=2 -mod=readonly -buildvcs=false"
}

# Build into a temporary folder and rename it into place, so an interrupted build never leaves
# a half-written cache entry that a later run would trust.
install_dir() { local final="$1"; rm -rf "$final.tmp"; mkdir -p "$final.tmp"; echo "$final.tmp"; }
commit_dir() { rm -rf "$1"; mv "$1.tmp" "$1"; }

build_localkube() {
  local d tmp; d="$(localkube_dir)"; tmp="$(install_dir "$d")"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  ld+=" -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  ld+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ld+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  (cd "$HERE/localkube" && go build -trimpath -ldflags "$ld" -o "$tmp/localkube" .)
  commit_dir "$d"
}

build_kwokstages() {
  local d tmp; d="$(kwokstages_dir)"; tmp="$(install_dir "$d")"
  (cd "$HERE/kwokstages" && go build -trimpath -ldflags "-s -w" -o "$tmp/kwokstages" .)
  commit_dir "$d"
}

build_kwok() {
  local d tmp; d="$(kwok_dir)"; tmp="$(install_dir "$d")"
  # `go install pkg@version` builds in kwok's own module graph (GOFLAGS=-mod is not allowed there).
  GOFLAGS="-p=2" GOBIN="$tmp" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  commit_dir "$d"
}

build_helm() {
  local d tmp; d="$(helm_dir)"; tmp="$(install_dir "$d")"
  GOFLAGS="-p=2" GOBIN="$tmp" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  commit_dir "$d"
}

build_prometheus() {
  command -v apt-get >/dev/null || die "apt-get not found: promtool/prometheus come from Debian's 'prometheus' package"
  local dl; dl="$(mktemp -d)"
  if ! (cd "$dl" && apt-get download prometheus >/dev/null 2>&1); then
    note "apt-get download failed; refreshing package lists"
    apt-get update -qq >/dev/null || die "apt-get update failed (needs root and the Debian mirror)"
    (cd "$dl" && apt-get download prometheus) || die "could not download Debian package 'prometheus'"
  fi
  local deb ver d tmp
  deb="$(ls "$dl"/prometheus_*.deb)"
  ver="$(dpkg-deb -f "$deb" Version)"
  d="$BIN/prometheus-$ver"; tmp="$(install_dir "$d")"
  dpkg -x "$deb" "$tmp"
  rm -rf "$dl" "$tmp/usr/share/doc" "$tmp/usr/share/man"
  commit_dir "$d"
}

ensure_time() {
  [[ -x /usr/bin/time ]] && return
  note "installing GNU time (Debian package 'time') to measure the cold build"
  apt-get install -y -qq time >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq time >/dev/null; }
}

cmd_build() {
  mkdir -p "$BIN"
  local todo; todo="$(missing)"
  [[ -z "$todo" ]] && { note "all binaries cached under $BIN"; return 0; }
  # Serialise concurrent builds (CI step and a pytest fixture, two checkouts) on the shared cache.
  exec 9>"$BIN/.build.lock"
  flock 9
  todo="$(missing)"
  [[ -z "$todo" ]] && { note "all binaries cached under $BIN"; return 0; }
  rm -rf "$BIN"/*.tmp # left by interrupted builds; safe to drop while holding the lock
  note "building: $(echo $todo)"
  ensure_time
  /usr/bin/time -v "$0" _build_missing
}

cmd_build_missing() {
  local name started
  for name in $(missing); do
    [[ "$name" == prometheus ]] && continue # promtool's package brings it
    started=$SECONDS
    note "building $name ..."
    case "$name" in
      localkube) go_env; build_localkube ;;
      kwokstages) go_env; build_kwokstages ;;
      kwok) go_env; build_kwok ;;
      helm) go_env; build_helm ;;
      promtool) build_prometheus ;;
    esac
    note "$name done in $((SECONDS - started)) s -> $(path_of "$name")"
  done
  local left; left="$(missing)"
  [[ -z "$left" ]] || die "still missing after build: $(echo $left)"
}

require_built() {
  local left; left="$(missing)"
  [[ -z "$left" ]] || die "not built: $(echo $left); run: $0 build"
}

pid_alive() { [[ -f "$STATE/pid" ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; }

cmd_up() {
  local foreground=0 args=()
  for a in "$@"; do
    if [[ "$a" == --foreground ]]; then foreground=1; else args+=("$a"); fi
  done
  require_built
  pid_alive && die "already running (pid $(cat "$STATE/pid")); run: $0 down"
  rm -rf "$STATE"; mkdir -p "$STATE"
  "$(path_of kwokstages)" >"$STATE/kwok-stages.yaml"
  local etcd_dir="$STATE/etcd"
  # etcd on tmpfs when there is one: no disk I/O on the shared CI machine.
  if [[ -d /dev/shm && -w /dev/shm ]]; then etcd_dir="$(mktemp -d /dev/shm/localkube-etcd.XXXXXX)"; fi
  echo "$etcd_dir" >"$STATE/etcd-dir"
  local cmd=("$(path_of localkube)" up --dir "$STATE" --etcd-dir "$etcd_dir"
    --kwok "$(path_of kwok)" --kwok-config "$STATE/kwok-stages.yaml" "${args[@]}")
  if ((foreground)); then
    echo $$ >"$STATE/pid"
    exec "${cmd[@]}"
  fi
  setsid "${cmd[@]}" >"$STATE/localkube.log" 2>&1 </dev/null &
  echo $! >"$STATE/pid"
  local deadline=$((SECONDS + 240))
  until [[ -f "$STATE/ready" ]]; do
    pid_alive || {
      tail -n 20 "$STATE/localkube.log" >&2
      cmd_down 2>/dev/null
      die "localkube exited during startup (logs: $STATE/logs)"
    }
    ((SECONDS < deadline)) || { cmd_down; die "not ready after 240 s (logs: $STATE/logs)"; }
    sleep 0.5
  done
  note "ready in $SECONDS s; $(cat "$STATE/ready")"
  cmd_env
}

cmd_down() {
  if pid_alive; then
    local pid; pid="$(cat "$STATE/pid")"
    # The supervisor leads its own session (setsid), so the group holds every component.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    note "stopped (pid $pid)"
  else
    note "not running"
  fi
  [[ -f "$STATE/etcd-dir" ]] && rm -rf "$(cat "$STATE/etcd-dir")"
  rm -f "$STATE/pid" "$STATE/ready" "$STATE/etcd-dir"
}

cmd_status() {
  if pid_alive && [[ -f "$STATE/ready" ]]; then
    echo "running: $(cat "$STATE/ready")"
  elif pid_alive; then
    echo "starting (pid $(cat "$STATE/pid"))"; return 1
  else
    echo "not running"; return 1
  fi
}

cmd_env() { echo "export KUBECONFIG=$STATE/kubeconfig"; }

main() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    build) cmd_build ;;
    _build_missing) cmd_build_missing ;;
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    path) [[ $# -eq 1 ]] || die "usage: $0 path NAME"; path_of "$1" ;;
    helm | promtool | prometheus | kwok) path_of "$cmd" ;;
    *) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
}

main "$@"
