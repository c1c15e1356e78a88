#!/usr/bin/env bash
# A local Kubernetes cluster without containers: real etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler, plus the LOCAL NODE AGENT
# (hack/local-node/local_node_agent.py), a dev/test stand-in for the kubelet that
# runs pods as host processes in their own network namespaces. Needs root.
#
#   hack/local-cluster.sh up            start (idempotent); last stdout line: kubeconfig path
#   hack/local-cluster.sh down [--purge] stop everything; --purge also deletes cluster state
#   hack/local-cluster.sh status        what runs
#
# Everything generated lives in $CACHE/cluster (PKI, etcd data, logs, pod dirs).
# Pods reach the API server at $BRIDGE_IP:6443 (the bridge's address, also the
# apiserver's advertise address and a SAN of its certificate).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
C="$CACHE/cluster"
PKI="$C/pki"
LOGS="$C/logs"
RUN="$C/run"
KUBECONFIG_OUT="$C/kubeconfig"
NODES="${LOCAL_CLUSTER_NODES:-2}"
BRIDGE="ao-br0"
BRIDGE_IP="10.244.0.1"
BRIDGE_CIDR="$BRIDGE_IP/16"
SERVICE_CIDR="10.96.0.0/16"
API_PORT=6443
# Non-default etcd and component ports: do not collide with other local etcds (envtest...).
ETCD_CLIENT_PORT=12379
ETCD_PEER_PORT=12380
COMPONENTS_START=(etcd kube-apiserver kube-controller-manager kube-scheduler local-node-agent)

say() { echo ">> $(date +%T) $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

[[ $EUID -eq 0 ]] || die "the local cluster needs root (network namespaces, bind mounts)"

# ---------------------------------------------------------------- tools
apt_updated=0
STARTED=""  # components this invocation started
need() {  # need <command> <debian package>: install missing host tools on a fresh machine
  command -v "$1" >/dev/null 2>&1 && return
  command -v apt-get >/dev/null || die "$1 is missing and apt-get is not available: install $2"
  if [[ $apt_updated == 0 ]]; then
    say "apt-get update"; DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2; apt_updated=1
  fi
  say "installing $2"; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >&2
}
ensure_tools() {
  need openssl openssl; need ip iproute2; need unshare util-linux; need nsenter util-linux
  need setsid util-linux; need flock util-linux
}

# ---------------------------------------------------------------- processes
pid_of() {  # prints the pid of a component if it runs (checks the binary to survive pid reuse)
  local f="$RUN/$1.pid" pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' </proc/"$pid"/cmdline | grep -q -e "$1" -e "${1//-/_}" || return 1
  echo "$pid"
}

start_bg() {  # start_bg <name> <command...>: detached, own session, stdio to the log
  local name=$1; shift
  pid_of "$name" >/dev/null && return 0
  say "starting $name (log: $LOGS/$name.log)"
  STARTED+=" $name "
  echo "---- $(date -u +%FT%TZ) start" >>"$LOGS/$name.log"
  # 9>&-: the daemons must not inherit (and hold forever) the up/down lock.
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 9>&- &
  local pid=$! i
  echo "$pid" >"$RUN/$name.pid"
  # Wait for the exec: until then /proc/PID/cmdline is bash's and pid_of would start a twin.
  for ((i = 0; i < 100; i++)); do
    pid_of "$name" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.02
  done
}

stop_one() {  # stop_one <name> <seconds>: SIGTERM, wait, SIGKILL
  local name=$1 wait_s=$2 pid i
  pid=$(pid_of "$name") || { rm -f "$RUN/$name.pid"; return 0; }
  say "stopping $name ($pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < wait_s * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$RUN/$name.pid"
}

# ---------------------------------------------------------------- PKI
issue() {  # issue <name> <subject> <extendedKeyUsage> [subjectAltName]
  local name=$1 subj=$2 eku=$3 san=${4:-}
  [[ -f $PKI/$name.crt ]] && return
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$PKI/$name.key" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } >"$PKI/$name.ext"
  openssl req -new -key "$PKI/$name.key" -subj "$subj" 2>/dev/null |
    openssl x509 -req -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -set_serial "0x$(openssl rand -hex 8)" \
      -days 3650 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
}

make_pki() {
  mkdir -p "$PKI"
  chmod 700 "$PKI"
  if [[ ! -f $PKI/ca.crt ]]; then
    say "generating PKI in $PKI"
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$PKI/ca.key" 2>/dev/null
    openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=accelerate-operator-local-ca" \
      -days 3650 -out "$PKI/ca.crt" 2>/dev/null
  fi
  issue apiserver "/CN=kube-apiserver" serverAuth \
    "IP:127.0.0.1,IP:10.96.0.1,IP:$BRIDGE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue admin "/O=system:masters/CN=kubernetes-admin" clientAuth
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
  issue controller-manager "/CN=system:kube-controller-manager" clientAuth
  issue scheduler "/CN=system:kube-scheduler" clientAuth
  # The agent's kubelet endpoint; the apiserver does not verify it (no --kubelet-certificate-authority).
  issue kubelet "/CN=local-node-agent" serverAuth "IP:127.0.0.1,DNS:localhost"
  if [[ ! -f $PKI/sa.key ]]; then
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$PKI/sa.key" 2>/dev/null
    openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
}

write_kubeconfig() {  # write_kubeconfig <file> <cert name> <user>: embedded data, portable
  local b64='base64 -w0'
  cat >"$1.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $($b64 <"$PKI/ca.crt")
users:
- name: $3
  user:
    client-certificate-data: $($b64 <"$PKI/$2.crt")
    client-key-data: $($b64 <"$PKI/$2.key")
contexts:
- name: local
  context: {cluster: local, user: $3}
current-context: local
EOF
  chmod 600 "$1.tmp"
  mv "$1.tmp" "$1"
}

# ---------------------------------------------------------------- network
ensure_bridge() {
  if [[ ! -e /sys/class/net/$BRIDGE ]]; then
    say "creating bridge $BRIDGE ($BRIDGE_CIDR)"
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_CIDR" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
}

remove_network() {
  local l
  for l in /sys/class/net/aov* /sys/class/net/aol*; do
    [[ -e $l ]] && ip link del "$(basename "$l")" 2>/dev/null || true
  done
  for l in /sys/class/net/ao-br*; do
    [[ -e $l ]] && { say "removing bridge $(basename "$l")"; ip link del "$(basename "$l")" || true; }
  done
}

# ---------------------------------------------------------------- health
kc() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }

ready_nodes() {  # how many of our nodes are Ready
  kc get nodes -l node.kubernetes.io/local-node-agent=true --request-timeout=5s \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
    2>/dev/null | grep -c True || true
}

healthy() {
  local c
  for c in "${COMPONENTS_START[@]}"; do pid_of "$c" >/dev/null || return 1; done
  [[ $(kc get --raw /readyz --request-timeout=5s 2>/dev/null) == ok ]] || return 1
  [[ $(ready_nodes) -ge $NODES ]]
}

wait_until() {  # wait_until <seconds> <description> <command...>
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@"; do
    if ((SECONDS > deadline)); then
      die "timed out waiting for $what; see the logs in $LOGS"
    fi
    sleep 0.3
  done
}

apiserver_ready() { [[ $(kc get --raw /readyz --request-timeout=5s 2>/dev/null) == ok ]]; }
nodes_ready() { [[ $(ready_nodes) -ge $NODES ]]; }
default_sa() { kc -n default get serviceaccount default --request-timeout=5s >/dev/null 2>&1; }

python_bin() {
  # The project venv: the agent needs requests+yaml, pods need accelerate-trainer on PATH.
  local venv
  if venv=$("$ROOT/hack/python-env.sh" 2>>"$LOGS/python-env.log" | tail -n1) && [[ -x $venv/bin/python ]]; then
    echo "$venv/bin/python"
  elif [[ -x $CACHE/venv/bin/python ]]; then
    echo "$CACHE/venv/bin/python"
  else
    die "no Python venv: run hack/python-env.sh (see $LOGS/python-env.log)"
  fi
}

start_apiserver() {
  start_bg etcd "$BIN/etcd" --name local --data-dir "$C/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes 8589934592 --log-level warn

  # 0.0.0.0: pods in network namespaces reach it through the bridge IP.
  # --request-timeout also bounds the graceful shutdown (60s by default, held open by
  # `kubectl logs -f` streams): after SIGTERM it now exits within about 20s.
  start_bg kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --bind-address 0.0.0.0 --secure-port "$API_PORT" --advertise-address "$BRIDGE_IP" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --authorization-mode Node,RBAC --allow-privileged=true \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --max-requests-inflight 800 --max-mutating-requests-inflight 400 \
    --request-timeout 20s \
    --profiling=false --v=1
}

start_apiserver_and_check() {
  start_apiserver
  apiserver_ready && return 0
  # An API server we did not start that stays unready for 15s is most likely stuck in its
  # graceful shutdown (it can take minutes after SIGTERM): kill it so the next round restarts it.
  if [[ $STARTED != *" kube-apiserver "* ]] && ((SECONDS - UP_BEGAN > 15)); then
    say "the running kube-apiserver is not ready after 15s: restarting it"
    stop_one kube-apiserver 0
  fi
  return 1
}

start_others() {
  start_bg kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$C/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$C/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$C/controller-manager.kubeconfig" \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --use-service-account-credentials --controllers '*' --enable-garbage-collector=true \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port 10357 \
    --kube-api-qps 200 --kube-api-burst 400 --concurrent-gc-syncs 40 --profiling=false --v=1

  start_bg kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig "$C/scheduler.kubeconfig" \
    --authentication-kubeconfig "$C/scheduler.kubeconfig" \
    --authorization-kubeconfig "$C/scheduler.kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port 10359 --profiling=false --v=1

  start_bg local-node-agent "$PY" "$ROOT/hack/local-node/local_node_agent.py" \
    --kubeconfig "$KUBECONFIG_OUT" --nodes "$NODES" --state-dir "$C" \
    --bridge "$BRIDGE" --bridge-cidr "$BRIDGE_CIDR" \
    --tls-cert "$PKI/kubelet.crt" --tls-key "$PKI/kubelet.key" --venv-bin "$(dirname "$PY")"
}

start_others_and_check() { start_others; nodes_ready; }

# ---------------------------------------------------------------- commands
cmd_up() {
  mkdir -p "$LOGS" "$RUN"
  BIN=$("$ROOT/hack/build-control-plane.sh" | tail -n1)
  if [[ -f $KUBECONFIG_OUT ]] && healthy; then
    echo "$KUBECONFIG_OUT"
    return
  fi
  ensure_tools
  make_pki
  write_kubeconfig "$KUBECONFIG_OUT" admin kubernetes-admin
  write_kubeconfig "$C/controller-manager.kubeconfig" controller-manager system:kube-controller-manager
  write_kubeconfig "$C/scheduler.kubeconfig" scheduler system:kube-scheduler
  ensure_bridge

  # A component still shutting down (just sent SIGTERM) counts as running, so the
  # wait loop below calls start_apiserver again and (re)starts whatever has exited.
  UP_BEGAN=$SECONDS
  start_apiserver
  wait_until 120 "the API server's /readyz" start_apiserver_and_check

  if [[ $STARTED == *" kube-apiserver "* ]]; then
    # The scheduler does not always recover its watches when the API server restarts
    # under it (seen with v1.34): restart the stateless components with it.
    stop_one kube-scheduler 10
    stop_one kube-controller-manager 10
  fi
  PY=$(python_bin)
  start_others
  wait_until 120 "$NODES Ready nodes" start_others_and_check
  wait_until 120 "the default ServiceAccount in namespace default" default_sa
  say "cluster is up: export KUBECONFIG=$KUBECONFIG_OUT"
  echo "$KUBECONFIG_OUT"
}

kill_stale_pods() {
  # If the agent died without cleaning up, kill the pod processes it recorded.
  [[ -d $C/pods ]] || return 0
  python3 - "$C/pods" <<'PY'
import glob, json, os, signal, sys
for f in glob.glob(os.path.join(sys.argv[1], "*", "state.json")):
    try:
        pids = json.load(open(f)).get("pids", [])
    except (OSError, ValueError):
        continue
    for pid, start in pids:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19] == start:
                os.killpg(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass
PY
}

cmd_down() {
  local purge=0
  [[ ${1:-} == --purge ]] && purge=1
  mkdir -p "$RUN"
  stop_one local-node-agent 30
  kill_stale_pods
  stop_one kube-scheduler 10
  stop_one kube-controller-manager 10
  stop_one kube-apiserver 5  # graceful shutdown can hang for a minute on open streams
  stop_one etcd 20
  remove_network
  if [[ $purge == 1 ]]; then
    say "deleting $C"
    rm -rf "$C"
  fi
}

cmd_status() {
  local c pid
  for c in "${COMPONENTS_START[@]}"; do
    if pid=$(pid_of "$c"); then echo "$c: running (pid $pid)"; else echo "$c: stopped"; fi
  done
  if [[ -e /sys/class/net/$BRIDGE ]]; then echo "bridge $BRIDGE: $BRIDGE_CIDR"; else echo "bridge $BRIDGE: absent"; fi
  if pid_of kube-apiserver >/dev/null; then
    BIN=$("$ROOT/hack/build-control-plane.sh" | tail -n1)
    echo "kubeconfig: $KUBECONFIG_OUT"
    kc get nodes --request-timeout=5s 2>&1 || true
  fi
}

lock() {  # serialise concurrent up/down (several test sessions share one cluster)
  command -v flock >/dev/null || need flock util-linux
  mkdir -p "$C"
  exec 9>"$C/.lock"
  flock 9
}

case "${1:-}" in
  up) lock; cmd_up ;;
  down) shift; lock; cmd_down "$@" ;;
  status) cmd_status ;;
  *) echo "usage: $0 up | down [--purge] | status" >&2; exit 2 ;;
esac
