#!/usr/bin/env bash
# Build deploy/Dockerfile.{server,worker} and run them for real, without a Docker engine or
# Docker Hub: daemonless podman/buildah (root), a Python base bootstrapped from Debian's
# packages, one shard container probed for health, then the Compose cluster (and its TLS
# overlay) with podman-compose until the demo's workers exit and report their accuracy.
#   bash scripts/images.sh          (or `make images`; the e2e test tests/e2e/test_images.py)
# Everything it starts (containers, the podman network, volumes, the firewall chains netavark
# adds) is removed on exit, also on failure. It is idempotent: tools, the base image (by the
# content of its recipe) and image layers are reused by the next run.
# Environment:
#   PY                     Python for the tools' venv (podman-compose, a gRPC health client)
#   PS_IMAGES_CACHE        tools venv, lock and logs (default /var/cache/psgrpc-images)
#   PS_IMAGES_CLUSTERS     which Compose clusters to run: "plain tls" (default), "plain", ""
#   PS_IMAGES_MIN_ACCURACY the demo's held-out accuracy must reach it (default 0.95; "": any)
#   PS_IMAGES_MIRROR       Debian mirror for the base (default: the host's own, else deb.debian.org)
#   PS_IMAGES_NOFILE, PS_IMAGES_NPROC   container ulimits (default: what the host allows)
#   PS_TORCH_SPEC          the worker's torch requirement (default: a CPU wheel pip finds
#                          locally, else the Dockerfile's default, PyTorch's CPU index)
#   PS_DEMO_EPOCHS         passed to Compose (the demo's length; the file's default otherwise)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

SUITE=bookworm # Debian 12: Python 3.11, what pyproject.toml requires
NET=psgrpc-images
PROJECT=psgrpc-images
SHARD=psgrpc-images-shard
PROBE=psgrpc-images-probe
BASE_REPO=localhost/psgrpc-base
SERVER_IMAGE=localhost/psgrpc-server:latest
WORKER_IMAGE=localhost/psgrpc-worker:latest
COMPOSE=(deploy/docker-compose.yml)
COMPOSE_TLS=(deploy/docker-compose.yml deploy/docker-compose.tls.yml)
PODMAN_COMPOSE_REQ="podman-compose==1.6.0"
MIN_ACCURACY=${PS_IMAGES_MIN_ACCURACY-0.95}
CLUSTERS=${PS_IMAGES_CLUSTERS-plain tls}
cache=${PS_IMAGES_CACHE:-/var/cache/psgrpc-images}
py=${PY:-python3}

say() { printf 'images: %s\n' "$*"; }
note() { printf 'images: workaround: %s\n' "$*"; }
die() {
  printf 'images: FAILED: %s\n' "$*" >&2
  exit 1
}
t0=$SECONDS
step_start=$SECONDS
timings=()
step() {
  step_start=$SECONDS
  say "== $*"
}
done_step() { timings+=("$1 $((SECONDS - step_start))s"); }
# Bounded commands: every external call that may hang goes through one of these.
t() {
  local limit=$1
  shift
  timeout --kill-after=10 "$limit" "$@"
}
# Bounded and quiet unless it fails. Without systemd, podman logs an error for every container
# with a health check ("unable to get systemd connection to add healthchecks"): expected here.
quiet() {
  local out rc=0
  out=$(t "$@" </dev/null 2>&1) || rc=$?
  [ "$rc" = 0 ] || printf '%s\n' "$out" >&2
  return "$rc"
}

[ "$(uname -s)" = Linux ] || die "needs Linux (podman and buildah run containers natively)"
[ "$(id -u)" = 0 ] || die "needs root: rootful podman and buildah (bridge networks, overlay storage)"
mkdir -p "$cache"
# One run at a time on this machine: they share the network, project and image names.
exec 9>"$cache/lock"
flock -w 900 9 || die "another scripts/images.sh held $cache/lock for 15 minutes"
work=$(mktemp -d "${TMPDIR:-/tmp}/psgrpc-images.XXXXXX")

# -- teardown: everything this run may have created, also after a failure ------------------
iptables_before=""
iptables_snapshot=0
teardown() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  say "== teardown"
  for project in "$PROJECT" "$PROJECT-tls"; do
    t 120 podman ps -a -q --filter "label=io.podman.compose.project=$project" 2>/dev/null |
      xargs -r timeout 120 podman rm -f -t 5 >/dev/null 2>&1
  done
  for name in "$SHARD" "$PROBE"; do
    t 60 podman rm -f -t 5 "$name" >/dev/null 2>&1
  done
  for project in "$PROJECT" "$PROJECT-tls"; do
    t 60 podman pod rm -f "pod_$project" >/dev/null 2>&1
  done
  for project in "$PROJECT" "$PROJECT-tls"; do
    t 60 podman volume ls -q --filter "label=io.podman.compose.project=$project" 2>/dev/null |
      xargs -r timeout 60 podman volume rm -f >/dev/null 2>&1
  done
  if command -v podman >/dev/null && t 30 podman network exists "$NET"; then
    t 60 podman network rm -f "$NET" >/dev/null || say "could not remove network $NET"
  fi
  iptables_cleanup
  # The last run's logs (builds, podman-compose, the services') stay for a look afterwards.
  rm -rf "$cache/last-run"
  mkdir -p "$cache/last-run"
  cp "$work"/*.log "$work"/*.yml "$cache/last-run/" 2>/dev/null
  rm -rf "$work"
  if [ "$rc" = 0 ]; then
    say "teardown done"
  else
    say "teardown done after a failure (exit $rc)"
  fi
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Firewall: the run's network is internal, for which netavark adds no NAT or port rules; on a
# netavark that adds chains (NETAVARK_*) and leaves them, the ones that were not there before
# this run are removed again, unless a container still runs or another bridge network exists
# that might rely on them. Without a snapshot from before the run nothing is touched.
iptables_rules() {
  command -v iptables >/dev/null || return 0
  local table
  for table in filter nat; do t 30 iptables -t "$table" -S 2>/dev/null | sed "s/^/$table /"; done
}
iptables_cleanup() {
  command -v iptables >/dev/null && [ "$iptables_snapshot" = 1 ] || return 0
  local new added table chain others
  new=$(comm -13 <(printf '%s\n' "$iptables_before" | sort) <(iptables_rules | sort) | sed '/^$/d')
  if [ -z "$new" ]; then
    say "iptables: this run left no rule behind"
    return 0
  fi
  added=$(awk '$2 == "-N" && $3 ~ /^NETAVARK/ {print $1, $3}' <<<"$new")
  others=$(t 30 podman network ls --format '{{.Name}} {{.Driver}}' 2>/dev/null | awk '$2 == "bridge" && $1 != "podman"')
  others+=$(t 30 podman ps -q 2>/dev/null)
  if [ -n "$added" ] && [ -z "$others" ]; then
    # The jumps into the chains first, then the chains (flushed) themselves.
    while read -r table chain; do
      t 30 iptables -t "$table" -S | grep -E "^-A [A-Z_]+ .*-j $chain( |\$)" | grep -v "^-A NETAVARK" |
        while read -r rule; do
          # shellcheck disable=SC2086
          t 30 iptables -t "$table" ${rule/#-A/-D}
        done
    done <<<"$added"
    while read -r table chain; do t 30 iptables -t "$table" -F "$chain"; done <<<"$added"
    while read -r table chain; do t 30 iptables -t "$table" -X "$chain"; done <<<"$added"
    say "iptables: removed the chains netavark added: $(awk '{print $2}' <<<"$added" | sort -u | tr '\n' ' ')"
    new=$(comm -13 <(printf '%s\n' "$iptables_before" | sort) <(iptables_rules | sort) | sed '/^$/d')
  fi
  # Rules in chains that existed before are not this script's to delete: say which they are.
  [ -z "$new" ] || say "iptables: rules added during this run remain (another podman user?): $(tr '\n' ';' <<<"$new")"
}

# -- 1. tools --------------------------------------------------------------------------------
step "tools"
need=()
for pair in podman:podman buildah:buildah runc:runc netavark:/usr/lib/podman/netavark \
  aardvark-dns:/usr/lib/podman/aardvark-dns iptables:iptables debootstrap:debootstrap; do
  pkg=${pair%%:*}
  probe=${pair#*:}
  if [ "${probe#/}" != "$probe" ]; then [ -x "$probe" ] || need+=("$pkg"); else
    command -v "$probe" >/dev/null || need+=("$pkg")
  fi
done
[ -e /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get to install them"
  say "installing ${need[*]} (Debian packages)"
  t 300 apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive t 600 apt-get install -y -qq --no-install-recommends "${need[@]}" \
    >"$work/apt.log" 2>&1 || die "apt-get install ${need[*]} failed: $(tail -5 "$work/apt.log")"
fi
# podman-compose and a gRPC health client, in their own venv (not the project's).
tools=$cache/tools
want="$PODMAN_COMPOSE_REQ grpcio-health-checking"
if [ ! -x "$tools/bin/python" ] || [ "$(cat "$tools/.req" 2>/dev/null)" != "$want" ]; then
  rm -rf "$tools"
  t 120 "$py" -m venv "$tools" || die "$py -m venv failed (set PY to a Python 3.11 with venv)"
  # shellcheck disable=SC2086
  t 600 "$tools/bin/python" -m pip install -q $want >"$work/pip-tools.log" 2>&1 ||
    die "pip install $want failed: $(tail -5 "$work/pip-tools.log")"
  echo "$want" >"$tools/.req"
fi
pcompose=("$tools/bin/podman-compose")
done_step tools

# -- 2. container configuration --------------------------------------------------------------
step "configuration"
# A containers.conf for this run only (CONTAINERS_CONF), read by podman and buildah.
nofile=${PS_IMAGES_NOFILE:-$(ulimit -Hn)}
nproc=${PS_IMAGES_NPROC:-$(ulimit -Hu)}
[ "$nofile" = unlimited ] && nofile=1048576
[ "$nproc" = unlimited ] && nproc=1048576
pid_max=$(cat /proc/sys/kernel/pid_max)
if [ -z "${PS_IMAGES_NPROC:-}" ] && [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
note "containers may not raise RLIMIT_NOFILE/NPROC above the host's (podman asks for 1048576):" \
  "default_ulimits nofile=$nofile nproc=$nproc in a containers.conf passed by CONTAINERS_CONF"
runtime=runc
if command -v crun >/dev/null; then
  note "crun refuses hybrid (v1 + v2) cgroup hierarchies such as this VM's: using runc"
fi
cgroup_manager=cgroupfs
[ -d /run/systemd/system ] && cgroup_manager=systemd
cat >"$cache/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "$runtime"
cgroup_manager = "$cgroup_manager"
events_logger = "file"
[network]
network_backend = "netavark"
EOF
# Kept in the cache: `CONTAINERS_CONF=$cache/containers.conf podman ...` looks at the images.
export CONTAINERS_CONF=$cache/containers.conf
export BUILDAH_RUNTIME=$runtime
podman_version=$(t 30 podman version --format '{{.Client.Version}}')
say "podman $podman_version, buildah $(t 30 buildah version | awk '/^Version:/ {print $2}'), $runtime"
if ! t 30 iptables -S >/dev/null 2>&1; then
  die "netavark needs a working iptables and 'iptables -S' fails here; try" \
    "'update-alternatives --set iptables /usr/sbin/iptables-legacy'"
fi
iptables_before=$(iptables_rules)
iptables_snapshot=1
done_step configuration

# -- 3. base image: Debian's Python 3.11 in a venv, bootstrapped from the apt mirror ---------
step "base image"
mirror=${PS_IMAGES_MIRROR:-}
if [ -z "$mirror" ]; then
  # The host's own Debian mirror when it has one (.sources or .list style).
  mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' |
    grep -E '/debian/?$' | head -1 || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
fi
build_base() {
  local rootfs=$work/rootfs
  t 900 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    die "debootstrap $SUITE from $mirror failed: $(tail -5 "$work/debootstrap.log")"
  # Debian's python3 is externally managed (PEP 668): a venv on PATH gives images their
  # `python` and `pip`, as python:3.11-slim does.
  t 120 chroot "$rootfs" /usr/bin/python3 -m venv /opt/python || die "venv in the base failed"
  # scripts/images.sh mounts the build host's pip settings over this file during its builds.
  echo "# pip's settings for this image's Python (none: pip's defaults)." >"$rootfs/etc/pip.conf"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/man "$rootfs"/usr/share/info \
    "$rootfs"/usr/share/locale "$rootfs"/root/.cache "$rootfs"/var/log/*.log \
    "$rootfs"/var/cache/debconf/*-old
  find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$rootfs/usr/share/doc" -type d -empty -delete
  # shellcheck disable=SC2016
  t 300 tar -C "$rootfs" --numeric-owner -c . | t 300 podman import --quiet \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python"]' \
    --message "debootstrap $SUITE minbase + python3 venv, from $mirror" - "$1" >/dev/null ||
    die "podman import of the base failed"
  rm -rf "$rootfs"
}
# Cached by content: the recipe above, the suite and the mirror.
base_tag=$(printf '%s\n' "$(declare -f build_base)" "$SUITE" "$mirror" | sha256sum | cut -c1-12)
BASE_IMAGE=$BASE_REPO:$base_tag
if t 30 podman image exists "$BASE_IMAGE"; then
  say "base $BASE_IMAGE is cached"
else
  say "bootstrapping the base: debootstrap $SUITE (python3, python3-venv) from $mirror"
  build_base "$BASE_IMAGE"
  # Older bases (another recipe or mirror) lose their tag; layers still in use stay.
  t 60 podman images --format '{{.Repository}}:{{.Tag}}' "$BASE_REPO" | grep -vx "$BASE_IMAGE" |
    xargs -r timeout 60 podman rmi >/dev/null 2>&1 || true
fi
# A throwaway container with no network: checks the runtime and the ulimits before any build.
if ! out=$(t 60 podman run --rm --network=none --name "$PROBE" "$BASE_IMAGE" \
  python -c 'import sys; print(sys.version.split()[0])' 2>&1); then
  case $out in
    *rlimit*) die "the runtime cannot set the containers' ulimits ($out); lower them with PS_IMAGES_NOFILE / PS_IMAGES_NPROC" ;;
    *) die "cannot run a container: $out" ;;
  esac
fi
say "base runs Python $out"
done_step base

# -- 4. pip inside the builds: the host's own pip configuration -------------------------------
# The host's pip settings (local wheel folders and indexes, constraints, the CA bundle it
# trusts) go into the builds: each local path read-only under /mnt (an empty folder of the
# base, so no mount point is left in a layer) and a pip.conf naming them over the base's
# placeholder /etc/pip.conf. pip in the builds then finds what the host's pip finds (the CPU
# torch wheel among them) and trusts the same certificates.
step "pip configuration for the builds"
mkdir -p "$work/mnt"
"$tools/bin/python" - "$work/pip.conf" >"$work/pip-mounts" <<'EOF' || die "reading the host's pip configuration failed"
import os, subprocess, sys
from pathlib import Path
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                     text=True, timeout=60, check=True).stdout
settings = {}
for line in out.splitlines():  # scope.name='value'; the environment's (:env:) come last
    key, _, value = line.partition("=")
    settings[key.split(".", 1)[-1]] = value.strip().strip("'\"")
KEYS = ("index-url", "extra-index-url", "find-links", "constraint", "cert", "trusted-host",
        "default-timeout", "timeout", "retries", "disable-pip-version-check")
mounts: dict[str, str] = {}
def place(path: str) -> str:
    return mounts.setdefault(path, f"/mnt/{len(mounts)}")
lines = ["# The build host's pip settings (scripts/images.sh), its local paths under /mnt.", "[global]"]
for name in KEYS:
    if name not in settings:
        continue
    tokens = []
    for token in settings[name].split():
        url = token.startswith("file://")
        path = token.removeprefix("file://")
        if path.startswith("/") and os.path.exists(path):
            if name.endswith("index-url") and Path(path).name == "simple":
                # A local index's pages link to files beside simple/: mount the whole index.
                path = place(str(Path(path).parent)) + "/simple"
            else:
                path = place(path)
            token = "file://" + path if url else path
        tokens.append(token)
    lines.append(f"{name} = {' '.join(tokens)}")
Path(sys.argv[1]).write_text("\n".join(lines) + "\n")
for host, target in mounts.items():
    print(f"{host}\t{target}")
EOF
mounts=(--volume "$work/mnt:/mnt:ro" --volume "$work/pip.conf:/etc/pip.conf:ro")
while IFS=$'\t' read -r host target; do
  if [ -d "$host" ]; then mkdir -p "$work$target"; else touch "$work$target"; fi
  mounts+=(--volume "$host:$target:ro")
done <"$work/pip-mounts"
say "pip in the builds: $(grep -v '^[[#]' "$work/pip.conf" | tr '\n' ';')"
say "  with $(awk -F'\t' '{printf "%s%s at %s", (NR > 1 ? ", " : ""), $1, $2}' "$work/pip-mounts")"
note "the host's CA bundle and pip settings are mounted into the builds, so pip there trusts" \
  "the same certificates and finds the same local wheels as the host's pip"
torch_args=()
if [ -n "${PS_TORCH_SPEC:-}" ]; then
  torch_args=(--build-arg "TORCH_SPEC=$PS_TORCH_SPEC")
else
  default=$(sed -n 's/^ARG TORCH_SPEC="\(.*\)"$/\1/p' deploy/Dockerfile.worker)
  version=$(printf '%s' "$default" | sed -n 's/^torch==\([^ ]*\).*/\1/p')
  local_wheel=""
  while IFS=$'\t' read -r host _; do
    [ -d "$host" ] || continue
    local_wheel=$(find "$host" -maxdepth 1 -name "torch-$version+cpu-*.whl" | head -1)
    [ -z "$local_wheel" ] || break
  done <"$work/pip-mounts"
  if [ -n "$local_wheel" ]; then
    torch_args=(--build-arg "TORCH_SPEC=torch==$version+cpu")
    note "the CPU torch wheel is on this machine ($local_wheel): TORCH_SPEC=torch==$version+cpu" \
      "instead of the Dockerfile's default ($default)"
  fi
fi
done_step pip

# -- 5. images --------------------------------------------------------------------------------
build() {
  local dockerfile=$1 image=$2 log
  log=$work/build-${1##*/}.log
  shift 2
  # docker format: OCI images drop HEALTHCHECK. The host's network: pip reaches the package
  # index as the host's pip does (nothing else runs during a build).
  if ! t 1200 buildah bud --format docker --pull=never --layers --network host \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" "${mounts[@]}" "$@" \
    -f "$dockerfile" -t "$image" . >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "building $image from $dockerfile failed (log above)"
  fi
  say "built $image: $(grep -c 'Using cache' "$log" || true) cached steps"
}
step "server image"
build deploy/Dockerfile.server "$SERVER_IMAGE"
done_step server
step "worker image"
build deploy/Dockerfile.worker "$WORKER_IMAGE" "${torch_args[@]}"
done_step worker
size() { t 30 podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }
sizes="base $(size "$BASE_IMAGE"), server $(size "$SERVER_IMAGE"), worker $(size "$WORKER_IMAGE")"
say "image sizes: $sizes"

step "image contents"
check_py() {
  t 120 podman run --rm --network=none --no-healthcheck --name "$PROBE" "$1" python -c "$2" </dev/null
}
torch_line=$(check_py "$WORKER_IMAGE" 'import torch; print(torch.__version__, torch.version.cuda)') ||
  die "the worker image cannot import torch"
case $torch_line in
  *" None") say "worker torch $torch_line: the CPU build (torch.version.cuda is None)" ;;
  *) [ -n "${PS_TORCH_SPEC:-}" ] || die "worker torch is not the CPU build: $torch_line"
     say "worker torch $torch_line (PS_TORCH_SPEC=$PS_TORCH_SPEC)" ;;
esac
check_py "$SERVER_IMAGE" 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)' ||
  die "the server image contains torch"
say "server image: no torch"
check_py "$SERVER_IMAGE" 'import psserver, pswire' >/dev/null || die "the server image cannot import psserver"
done_step contents

# -- 6. one shard container, probed for health ------------------------------------------------
step "network"
# An internal network: the containers reach each other (and the host on the bridge) only.
t 60 podman network rm -f "$NET" >/dev/null 2>&1 || true
t 60 podman network create --internal "$NET" >/dev/null || die "podman network create $NET failed"
say "network $NET: $(t 30 podman network inspect "$NET" --format '{{range .Subnets}}{{.Subnet}}{{end}}'), internal"
done_step network

step "shard container"
# No systemd here to schedule health checks: `podman healthcheck run` probes on demand.
note "no systemd timer runs podman's health checks here: they run on demand with podman healthcheck run"
wait_healthy() {
  local name=$1 deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    if t 30 podman healthcheck run "$name" >/dev/null 2>&1; then return 0; fi
    [ "$(t 30 podman inspect -f '{{.State.Running}}' "$name")" = true ] || {
      t 30 podman logs --tail 30 "$name" >&2
      die "$name exited before it was healthy"
    }
    sleep 1
  done
  t 30 podman logs --tail 30 "$name" >&2
  die "$name was not healthy within $2 s"
}
quiet 60 podman run -d --name "$SHARD" --network "$NET" -e PS_PORT=7000 "$SERVER_IMAGE" ||
  die "starting the shard container failed"
wait_healthy "$SHARD" 60
say "shard container: the image's HEALTHCHECK passes (podman healthcheck run)"
ip=$(t 30 podman inspect -f "{{(index .NetworkSettings.Networks \"$NET\").IPAddress}}" "$SHARD")
health=$(t 60 "$tools/bin/python" - "$ip:7000" <<'EOF'
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    grpc.channel_ready_future(channel).result(timeout=20)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
EOF
) || die "the gRPC health client on the host got no answer from $ip:7000"
say "shard health from the host ($ip:7000): $health"
[ "$health" = SERVING ] || die "the shard answered $health, not SERVING"
quiet 60 podman stop -t 30 "$SHARD" || die "stopping the shard container failed"
code=$(t 30 podman inspect -f '{{.State.ExitCode}}' "$SHARD")
[ "$code" = 0 ] || die "the shard exited $code on SIGTERM"
quiet 30 podman rm "$SHARD" || die "removing the shard container failed"
done_step shard

# -- 7. the Compose clusters ------------------------------------------------------------------
# The stages come from the Compose files: one-shot services that others wait for with
# service_completed_successfully, then services others wait for with service_healthy, then the
# jobs nothing depends on, each started when what it depends on is ready.
if [ "${podman_version%%.*}" -lt 5 ] && [ "$(printf '%s\n' "$podman_version" 4.6 | sort -V | head -1)" != 4.6 ]; then
  note "podman $podman_version < 4.6: podman-compose ignores depends_on conditions" \
    "(service_healthy, service_completed_successfully); services start stage by stage, each" \
    "waiting for what it depends on"
fi
accuracies=()
cluster() {
  local label=$1 project=$2
  shift 2
  local files=() f
  for f in "$@"; do files+=(-f "$root/$f"); done
  # Only this run's network: the override attaches every service to it.
  cat >"$work/network.yml" <<EOF
networks:
  default:
    name: $NET
    external: true
EOF
  files+=(-f "$work/network.yml")
  # No pod: each service its own container on the network, as Docker Compose runs them.
  local pc=("${pcompose[@]}" --in-pod false -p "$project" "${files[@]}")
  t 120 "${pc[@]}" config >"$work/$project.yml" 2>"$work/$project.err" ||
    die "podman-compose config failed: $(tail -5 "$work/$project.err")"
  "$tools/bin/python" - "$work/$project.yml" >"$work/$project.stages" <<'EOF' ||
import sys, yaml
services = {
    name: s for name, s in yaml.safe_load(open(sys.argv[1]))["services"].items()
    if not s.get("profiles")
}
def deps(s):
    d = s.get("depends_on") or {}
    return {k: "service_started" for k in d} if isinstance(d, list) else {
        k: (v or {}).get("condition", "service_started") for k, v in d.items()}
kind = {name: "job" for name in services}
for s in services.values():
    for dep, cond in deps(s).items():
        if dep in services:
            kind[dep] = {"service_completed_successfully": "once",
                         "service_healthy": "healthy"}.get(cond, "started")
level = {}
def depth(name, seen=()):
    if name not in level:
        if name in seen:
            sys.exit(f"dependency cycle through {name}")
        ds = [d for d in deps(services[name]) if d in services]
        level[name] = 1 + max((depth(d, (*seen, name)) for d in ds), default=-1)
    return level[name]
for name in sorted(services, key=lambda n: (depth(n), n)):
    print(depth(name), kind[name], name)
EOF
    die "reading the stages of $* failed"
  say "$label stages: $(awk '{printf "%s%s:%s", (NR > 1 ? ", " : ""), $3, $2}' "$work/$project.stages")"
  local up_start=$SECONDS current=-1 depth kind name jobs=()
  local -A container=()
  start_level() {
    local names=("$@")
    [ ${#names[@]} -gt 0 ] || return 0
    t 300 "${pc[@]}" up -d --no-build --no-deps "${names[@]}" </dev/null >"$work/$project.up.log" 2>&1 ||
      die "podman-compose up ${names[*]} failed: $(tail -20 "$work/$project.up.log")"
  }
  # Waits for every service of the level just started, by its kind.
  settle_level() {
    local n c
    for n in "$@"; do
      c=$(t 30 podman ps -a -q --filter "label=io.podman.compose.project=$project" \
        --filter "label=io.podman.compose.service=$n" | head -1)
      [ -n "$c" ] || die "no container for service $n"
      container[$n]=$c
      case ${kinds[$n]} in
        once)
          c=$(t 300 podman wait "${container[$n]}") || die "$n did not finish within 300 s"
          [ "$c" = 0 ] || { t 30 podman logs "${container[$n]}" >&2; die "$n exited $c"; }
          say "$label: $n finished" ;;
        healthy)
          wait_healthy "${container[$n]}" 120
          # The daemon's own line says how it serves (plaintext, TLS, mutual TLS).
          c=$(t 30 podman logs "${container[$n]}" 2>&1 | grep -o 'listening on [^"]*' | head -1)
          say "$label: $n healthy${c:+ ($c)}" ;;
      esac
    done
  }
  local -A kinds=()
  local batch=()
  while read -r depth kind name <&3; do
    kinds[$name]=$kind
    if [ "$depth" != "$current" ]; then
      start_level "${batch[@]}"
      settle_level "${batch[@]}"
      batch=()
      current=$depth
    fi
    batch+=("$name")
    [ "$kind" = job ] && jobs+=("$name")
  done 3<"$work/$project.stages"
  start_level "${batch[@]}"
  settle_level "${batch[@]}"
  [ ${#jobs[@]} -gt 0 ] || die "$label: no job (a service nothing depends on) to wait for"
  local code acc over accs=() deadline=$((SECONDS + 900))
  for name in "${jobs[@]}"; do
    code=$(t $((deadline > SECONDS ? deadline - SECONDS : 1)) podman wait "${container[$name]}") ||
      die "$label: $name did not finish within 900 s of the jobs' start"
    t 30 podman logs "${container[$name]}" >"$work/$project.$name.log" 2>&1
    if [ "$code" != 0 ]; then
      tail -30 "$work/$project.$name.log" >&2
      die "$label: $name exited $code"
    fi
    # The demo's chief (worker 0) evaluates and prints the job's accuracy; the others do not.
    acc=$(sed -n 's/.*held-out accuracy \([0-9.]*\).*/\1/p' "$work/$project.$name.log" | tail -1)
    if [ -z "$acc" ]; then
      say "$label: $name exited 0"
      continue
    fi
    over=$(sed -n 's/.*held-out accuracy.* over \([0-9]*\) workers.*/\1/p' "$work/$project.$name.log" | tail -1)
    say "$label: $name exited 0, held-out accuracy $acc (trained by ${over:-?} workers)"
    if [ -n "$MIN_ACCURACY" ]; then
      awk -v a="$acc" -v m="$MIN_ACCURACY" 'BEGIN {exit !(a >= m)}' ||
        die "$label: $name's accuracy $acc is below $MIN_ACCURACY"
    fi
    accs+=("$name=$acc over ${over:-?} workers")
  done
  if [ -n "$MIN_ACCURACY" ] && [ ${#accs[@]} = 0 ]; then
    die "$label: no job printed a held-out accuracy (${jobs[*]})"
  fi
  accuracies+=("$label: ${accs[*]} ($((SECONDS - up_start)) s)")
  for name in "${!container[@]}"; do
    t 30 podman logs "${container[$name]}" >"$work/$project.$name.log" 2>&1
  done
  t 300 "${pc[@]}" down -v -t 30 >"$work/$project.down.log" 2>&1 ||
    say "podman-compose down failed (teardown removes what is left): $(tail -3 "$work/$project.down.log")"
}
for which in $CLUSTERS; do
  case $which in
    plain) step "Compose cluster"; cluster compose "$PROJECT" "${COMPOSE[@]}"; done_step compose ;;
    tls) step "Compose cluster with TLS"; cluster compose+tls "$PROJECT-tls" "${COMPOSE_TLS[@]}"; done_step compose+tls ;;
    *) die "PS_IMAGES_CLUSTERS: unknown cluster '$which' (plain, tls)" ;;
  esac
done

say "== summary"
say "image sizes: $sizes"
for line in "${accuracies[@]}"; do say "accuracy $line"; done
say "timings: ${timings[*]}"
say "OK in $((SECONDS - t0)) s"
