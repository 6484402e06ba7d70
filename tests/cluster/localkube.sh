#!/usr/bin/env bash
# Local Kubernetes control plane, helm and Prometheus for rljob's tests and local development.
#
#   localkube.sh build                 build or reuse every binary (cached by version, outside the repo)
#   localkube.sh up [--foreground] [localkube up flags, e.g. --nvidia-nodes 4 --amd-nodes 0]
#   localkube.sh up --real-node [--real-node-images operator,runtime-thin]   plus one real node
#   localkube.sh down | status | env   stop / report / print `export KUBECONFIG=...`
#   localkube.sh images [NAME ...]     build or reuse the real node's images (tests/cluster/images.py)
#   localkube.sh node-clean            remove what a killed real node left behind (waits for its lock)
#   localkube.sh path NAME             path of a binary (localkube, kwok, helm, nodekube, coredns, kube-router, weed, registry, ...)
#   localkube.sh helm|promtool|prometheus   shorthand for `path NAME`
#
# Environment: RLJOB_CACHE (binary cache root, default ~/.cache/rljob), LOCALKUBE_DIR (state of
# the running plane, default <repo>/.cache/localkube).
set -euo pipefail

K8S_VERSION=v1.36.3
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
CNI_PLUGINS_VERSION=v1.9.1
COREDNS_VERSION=v1.15.0
# The real node's NetworkPolicy implementation: kube-router's firewall (iptables + ipset) only. SIG
# Network's kube-network-policies needs nftables' `queue` expression, which this machine's kernel
# lacks (CONFIG_NFT_QUEUE unset, no loadable modules); see docs/development.md, "The real node".
KUBE_ROUTER_VERSION=v2.1.0
# The S3-compatible object store the checkpoint tests write to (tests/helpers/object_store.py).
# SeaweedFS (Apache-2.0); MinIO's server is AGPL. A pseudo-version: the module has no semver tags.
SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
# The real node (`up --real-node`): one per machine, so its state and lock are machine-wide.
REAL_NODE_LOCK=/run/rljob-real-node.lock
REAL_NODE_ROOT=/var/lib/rljob-real-node

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${RLJOB_CACHE:-$HOME/.cache/rljob}"
BIN="$CACHE/bin"
STATE="${LOCALKUBE_DIR:-$REPO/.cache/localkube}"

die() { echo "localkube.sh: $*" >&2; exit 1; }
note() { echo "localkube.sh: $*" >&2; }

# Cache keys: a version, plus a hash of our own sources where we compile them, so an edit to the
# supervisor or a go.mod bump rebuilds and everything else is reused.
# src_hash DIR [EXTRA_GLOB]: go.mod, go.sum (when there is one), EXTRA_GLOB's files, then ./*.go.
src_hash() { (cd "$1" && cat go.mod $([[ -f go.sum ]] && echo go.sum) ${2:-} ./*.go) | sha256sum | cut -c1-12; }
localkube_dir() { echo "$BIN/localkube-$K8S_VERSION-$(src_hash "$HERE/localkube")"; }
# kubelet + kube-proxy: the same module (go.mod, go.sum) as localkube, its own main package.
nodekube_dir() {
  echo "$BIN/nodekube-$K8S_VERSION-$( (cd "$HERE/localkube" && cat go.mod go.sum nodekube/*.go) | sha256sum | cut -c1-12)"
}
kwokstages_dir() { echo "$BIN/kwokstages-$KWOK_VERSION-$(src_hash "$HERE/kwokstages")"; }
kwok_dir() { echo "$BIN/kwok-$KWOK_VERSION"; }
helm_dir() { echo "$BIN/helm-$HELM_VERSION"; }
cni_dir() { echo "$BIN/cni-plugins-$CNI_PLUGINS_VERSION"; }
coredns_dir() { echo "$BIN/coredns-$COREDNS_VERSION-$(src_hash "$HERE/coredns")"; }
kube_router_dir() { echo "$BIN/kube-router-$KUBE_ROUTER_VERSION"; }
seaweedfs_dir() { echo "$BIN/seaweedfs-$SEAWEEDFS_VERSION"; }
pause_dir() { echo "$BIN/pause-$(src_hash "$HERE/pause")"; }
# The Debian version is only known after download, so the newest extracted one is used.
deb_dir() { find "$BIN" -maxdepth 1 -type d -name "$1-[0-9]*" 2>/dev/null | sort -V | tail -n 1; }
prometheus_dir() { deb_dir prometheus; }

path_of() {
  case "$1" in
    localkube) echo "$(localkube_dir)/localkube" ;;
    kwokstages) echo "$(kwokstages_dir)/kwokstages" ;;
    kwok) echo "$(kwok_dir)/kwok" ;;
    helm) echo "$(helm_dir)/helm" ;;
    promtool | prometheus) local d; d="$(prometheus_dir)"; echo "${d:-$BIN/prometheus-MISSING}/usr/bin/$1" ;;
    nodekube) echo "$(nodekube_dir)/nodekube" ;;
    cni-plugins) echo "$(cni_dir)" ;; # a folder: bridge, host-local, loopback, portmap
    coredns) echo "$(coredns_dir)/coredns" ;;
    kube-router) echo "$(kube_router_dir)/kube-router" ;;
    weed) echo "$(seaweedfs_dir)/weed" ;;
    registry) local d; d="$(deb_dir docker-registry)"; echo "${d:-$BIN/docker-registry-MISSING}/usr/bin/docker-registry" ;;
    pause) echo "$(pause_dir)/pause" ;;
    containerd) local d; d="$(deb_dir containerd)"; echo "${d:-$BIN/containerd-MISSING}/usr/bin" ;; # a folder
    runc) local d; d="$(deb_dir runc)"; echo "${d:-$BIN/runc-MISSING}/usr/sbin/runc" ;;
    busybox) local d; d="$(deb_dir busybox-static)"; echo "${d:-$BIN/busybox-static-MISSING}/bin/busybox" ;;
    *) die "unknown binary '$1' (${ALL[*]})" ;;
  esac
}

CONTROL_PLANE=(localkube kwokstages kwok helm promtool prometheus)
REAL_NODE=(nodekube cni-plugins coredns kube-router pause containerd runc busybox)
OBJECT_STORE=(weed)
# The container registry `make images` pushes to in tests/integration/test_images_push.py: Debian's
# docker-registry, the CNCF distribution registry (the OCI distribution API), on loopback.
REGISTRY=(registry)
ALL=("${CONTROL_PLANE[@]}" "${REAL_NODE[@]}" "${OBJECT_STORE[@]}" "${REGISTRY[@]}")

present() {
  local p; p="$(path_of "$1")"
  case "$1" in
    cni-plugins) [[ -x "$p/bridge" && -x "$p/host-local" && -x "$p/loopback" && -x "$p/portmap" ]] ;;
    containerd) [[ -x "$p/containerd" && -x "$p/containerd-shim-runc-v2" && -x "$p/ctr" ]] ;;
    *) [[ -x "$p" ]] ;;
  esac
}

missing() {
  local name
  for name in "${ALL[@]}"; do present "$name" || echo "$name"; done
}

go_env() {
  command -v go >/dev/null || die "Go is not installed; install Go >= 1.26 (the Kubernetes ${K8S_VERSION} module needs it)"
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-p=2 -mod=readonly -buildvcs=false"
}

# Build into a temporary folder and rename it into place, so an interrupted build never leaves
# a half-written cache entry that a later run would trust.
install_dir() { local final="$1"; rm -rf "$final.tmp"; mkdir -p "$final.tmp"; echo "$final.tmp"; }
commit_dir() { rm -rf "$1"; mv "$1.tmp" "$1"; }

k8s_ldflags() {
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  ld+=" -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  ld+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ld+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  echo "$ld"
}

build_localkube() {
  local d tmp; d="$(localkube_dir)"; tmp="$(install_dir "$d")"
  (cd "$HERE/localkube" && go build -trimpath -ldflags "$(k8s_ldflags)" -o "$tmp/localkube" .)
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

# Extract a Debian package into $BIN/<package>-<version> (no system install, no maintainer scripts).
build_deb() {
  local pkg="$1"
  command -v apt-get >/dev/null || die "apt-get not found: $pkg comes from Debian"
  local dl; dl="$(mktemp -d)"
  if ! (cd "$dl" && apt-get download "$pkg" >/dev/null 2>&1); then
    note "apt-get download failed; refreshing package lists"
    apt-get update -qq >/dev/null || die "apt-get update failed (needs root and the Debian mirror)"
    (cd "$dl" && apt-get download "$pkg") || die "could not download Debian package '$pkg'"
  fi
  local deb ver d tmp
  deb="$(ls "$dl"/"${pkg}"_*.deb)"
  ver="$(dpkg-deb -f "$deb" Version)"
  d="$BIN/$pkg-${ver//:/_}"; tmp="$(install_dir "$d")"
  dpkg -x "$deb" "$tmp"
  rm -rf "$dl" "$tmp/usr/share/doc" "$tmp/usr/share/man"
  commit_dir "$d"
}

build_prometheus() { build_deb prometheus; }

build_nodekube() {
  local d tmp; d="$(nodekube_dir)"; tmp="$(install_dir "$d")"
  (cd "$HERE/localkube" && go build -trimpath -ldflags "$(k8s_ldflags)" -o "$tmp/nodekube" ./nodekube)
  commit_dir "$d"
}

build_cni_plugins() {
  local d tmp; d="$(cni_dir)"; tmp="$(install_dir "$d")"
  local p
  for p in main/bridge main/loopback ipam/host-local meta/portmap; do
    GOFLAGS="-p=2" GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
      "github.com/containernetworking/plugins/plugins/$p@$CNI_PLUGINS_VERSION"
  done
  commit_dir "$d"
}

build_coredns() {
  local d tmp; d="$(coredns_dir)"; tmp="$(install_dir "$d")"
  (cd "$HERE/coredns" && go build -trimpath -ldflags "-s -w" -o "$tmp/coredns" .)
  commit_dir "$d"
}

build_kube_router() {
  local d tmp; d="$(kube_router_dir)"; tmp="$(install_dir "$d")"
  GOFLAGS="-p=2" GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
  commit_dir "$d"
}

# `go install mod@version` refuses SeaweedFS (its go.mod has replace directives), so the module is
# downloaded, copied out of the read-only module cache and built in place.
build_seaweedfs() {
  local d tmp src; d="$(seaweedfs_dir)"; tmp="$(install_dir "$d")"
  src="$(GOFLAGS= go mod download -json "github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  [[ -d "$src" ]] || die "go mod download of seaweedfs@$SEAWEEDFS_VERSION gave no source folder"
  cp -r "$src" "$tmp/src" && chmod -R u+w "$tmp/src"
  (cd "$tmp/src" && GOFLAGS="-p=2 -buildvcs=false" go build -trimpath -ldflags "-s -w" -o "$tmp/weed" ./weed)
  rm -rf "$tmp/src"
  commit_dir "$d"
}

build_pause() {
  local d tmp; d="$(pause_dir)"; tmp="$(install_dir "$d")"
  (cd "$HERE/pause" && go build -trimpath -ldflags "-s -w" -o "$tmp/pause" .)
  commit_dir "$d"
}

# Host tools from Debian, installed once when missing (needs root and the mirror): GNU time measures
# the cold build; kube-proxy on the real node programs Services with iptables and flushes UDP
# conntrack entries; kube-router enforces NetworkPolicies with iptables and ipset. Checked on every build, also when every binary is cached, because a restored
# cache on a new machine brings no system packages.
HOST_TOOLS=("/usr/bin/time:time" "iptables:iptables" "iptables-restore:iptables" "conntrack:conntrack" "ipset:ipset")

ensure_host_tools() {
  local entry cmd pkg pkgs=()
  for entry in "${HOST_TOOLS[@]}"; do
    cmd="${entry%%:*}"; pkg="${entry##*:}"
    command -v "$cmd" >/dev/null 2>&1 || pkgs+=("$pkg")
  done
  ((${#pkgs[@]} == 0)) && return 0
  command -v apt-get >/dev/null || die "missing host tools (${pkgs[*]}) and no apt-get to install them"
  note "installing Debian packages: ${pkgs[*]}"
  apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null && apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${pkgs[@]}" >/dev/null; } ||
    die "could not install ${pkgs[*]} (needs root and Debian's mirror)"
}

cmd_build() {
  mkdir -p "$BIN"
  ensure_host_tools
  local todo; todo="$(missing)"
  [[ -z "$todo" ]] && { note "all binaries cached under $BIN"; return 0; }
  # Serialise concurrent builds (CI step and a pytest fixture, two checkouts) on the shared cache.
  exec 9>"$BIN/.build.lock"
  flock 9
  todo="$(missing)"
  [[ -z "$todo" ]] && { note "all binaries cached under $BIN"; return 0; }
  rm -rf "$BIN"/*.tmp # left by interrupted builds; safe to drop while holding the lock
  note "building: $(echo $todo)"
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
      nodekube) go_env; build_nodekube ;;
      cni-plugins) go_env; build_cni_plugins ;;
      coredns) go_env; build_coredns ;;
      kube-router) go_env; build_kube_router ;;
      weed) go_env; build_seaweedfs ;;
      pause) go_env; build_pause ;;
      containerd | runc) build_deb "$name" ;;
      busybox) build_deb busybox-static ;;
      registry) build_deb docker-registry ;;
    esac
    note "$name done in $((SECONDS - started)) s -> $(path_of "$name")"
  done
  local left; left="$(missing)"
  [[ -z "$left" ]] || die "still missing after build: $(echo $left)"
}

require_built() {
  local name left=()
  for name in "$@"; do present "$name" || left+=("$name"); done
  ((${#left[@]} == 0)) || die "not built: ${left[*]}; run: $0 build"
}

# Images for the real node (tests/cluster/images.py, cached by input hash). Prints NAME ARCHIVE REF.
cmd_images() {
  command -v python3 >/dev/null || die "python3 is needed to build the real node's images"
  (cd "$REPO" && python3 -m tests.cluster.images build "$@")
}

pid_alive() { [[ -f "$STATE/pid" ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; }

cmd_up() {
  local foreground=0 real_node=0 images=() args=()
  while (($#)); do
    case "$1" in
      --foreground) foreground=1 ;;
      --real-node) real_node=1 ;;
      --real-node-images) shift; IFS=, read -r -a images <<<"$1" ;;
      --real-node-images=*) IFS=, read -r -a images <<<"${1#*=}" ;;
      *) args+=("$1") ;;
    esac
    shift
  done
  require_built "${CONTROL_PLANE[@]}"
  pid_alive && die "already running (pid $(cat "$STATE/pid")); run: $0 down"
  rm -rf "$STATE"; mkdir -p "$STATE"
  if ((real_node)); then
    require_built "${REAL_NODE[@]}"
    local name archive ref
    args+=(--real-node --real-node-root "$REAL_NODE_ROOT" --real-node-lock "$REAL_NODE_LOCK"
      --nodekube "$(path_of nodekube)" --containerd-bin-dir "$(path_of containerd)"
      --runc "$(path_of runc)" --cni-bin-dir "$(path_of cni-plugins)" --coredns "$(path_of coredns)"
      --kube-router "$(path_of kube-router)")
    while read -r name archive ref; do
      if [[ "$name" == pause ]]; then
        args+=(--pause-image "$ref" --pause-image-archive "$archive")
      else
        args+=(--real-node-image "$archive")
      fi
      echo "$name $ref" >>"$STATE/images"
    done < <(cmd_images pause busybox "${images[@]}")
    [[ -f "$STATE/images" ]] || die "could not build the real node's images"
  fi
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
    images) cmd_images "$@" ;;
    node-clean) require_built localkube; "$(path_of localkube)" node-clean --real-node-root "$REAL_NODE_ROOT" --real-node-lock "$REAL_NODE_LOCK" ;;
    _build_missing) cmd_build_missing ;;
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    path) [[ $# -eq 1 ]] || die "usage: $0 path NAME"; path_of "$1" ;;
    helm | promtool | prometheus | kwok) path_of "$cmd" ;;
    *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
}

main "$@"
