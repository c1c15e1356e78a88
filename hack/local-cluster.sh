#!/usr/bin/env bash
# A real Kubernetes cluster without Docker: etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler on the host, and $NODES nodes, each a kubelet + kube-proxy + containerd/runc with
# CNI bridge networking in network and mount namespaces of its own (hack/lib/nodes.sh), with
# CoreDNS behind the kube-dns Service (two replicas on different nodes, as kubeadm and kind run
# it). All of it is built from the Go module proxy and Debian's packages; images are built
# locally and loaded into every node (hack/load-images.sh). Needs root.
#
#   hack/local-cluster.sh up              start (idempotent); last stdout line: kubeconfig path
#   hack/local-cluster.sh down [--purge]  stop everything; --purge also deletes cluster state
#   hack/local-cluster.sh status          what runs
#   hack/local-cluster.sh exec NODE CMD   run CMD on a node (e.g. `exec ao-node-1 crictl ps`)
#   hack/local-cluster.sh node-kill NODE  a power loss: every process of the node killed; `up`
#                                         starts it again
#
# Everything generated lives in $CACHE/cluster (PKI, etcd data, logs, node folders with their
# containerd image stores). Nodes and pods reach the API server at $NODE_GATEWAY_IP:6443 (the
# host's address on the node bridge, the apiserver's advertise address).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
C="$CACHE/cluster"
PKI="$C/pki"
LOGS="$C/logs"
RUN="$C/run"
KUBECONFIG_OUT="$C/kubeconfig"
NODES="${LOCAL_CLUSTER_NODES:-2}"
NODE_BRIDGE="ao-br0"           # the nodes' network: node i is 10.240.0.(10+i)
NODE_GATEWAY_IP="10.240.0.1"
POD_CIDR="10.244.0.0/16"       # node i's pods: 10.244.(i+1).0/24
SERVICE_CIDR="10.96.0.0/16"
CLUSTER_DNS_IP="10.96.0.10"
CNI_BIN_DIR="${CNI_BIN_DIR:-/usr/lib/cni}"
API_PORT=6443
# Non-default etcd and component ports: do not collide with other local etcds (envtest...).
ETCD_CLIENT_PORT=12379
ETCD_PEER_PORT=12380
CONTROL_PLANE=(etcd kube-apiserver kube-controller-manager kube-scheduler)
# shellcheck source=hack/lib/nodes.sh
source "$ROOT/hack/lib/nodes.sh"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
node_components() {
  local i
  for ((i = 0; i < NODES; i++)); do
    echo "containerd@$(node_name "$i") kubelet@$(node_name "$i") kube-proxy@$(node_name "$i")"
  done
}

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
  need setsid util-linux; need flock util-linux; need findmnt util-linux
  need containerd containerd; need runc runc; need iptables iptables; need conntrack conntrack
  [[ -x $CNI_BIN_DIR/bridge ]] || need /usr/lib/cni/bridge containernetworking-plugins
}

# ---------------------------------------------------------------- processes
start_time() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }  # survives exec, not pid reuse

pid_of() {  # prints the pid of a component if it runs (pid and start time both recorded)
  local f="$RUN/$1.pid" pid started
  [[ -f $f ]] || return 1
  read -r pid started <"$f" || return 1
  [[ -n $pid && -n $started && $(start_time "$pid") == "$started" ]] || return 1
  echo "$pid"
}

start_bg() {  # start_bg <name> <command...>: detached, own session, stdio to the log
  local name=$1; shift
  # A daemon started with other flags (an older checkout of this script) is restarted.
  local args_hash; args_hash=$(printf '%s\n' "$@" | sha256sum | cut -c1-16)
  if pid_of "$name" >/dev/null; then
    [[ "$(cat "$RUN/$name.args" 2>/dev/null)" != "$args_hash" ]] || return 0
    say "$name runs with other flags: restarting it"
    stop_one "$name" 30
  fi
  echo "$args_hash" >"$RUN/$name.args"
  say "starting $name (log: $LOGS/$name.log)"
  STARTED+=" $name "
  echo "---- $(date -u +%FT%TZ) start" >>"$LOGS/$name.log"
  # 9>&-: the daemons must not inherit (and hold forever) the up/down lock.
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 9>&- &
  local pid=$!
  echo "$pid $(start_time "$pid")" >"$RUN/$name.pid"
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
    "IP:127.0.0.1,IP:10.96.0.1,IP:$NODE_GATEWAY_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue admin "/O=system:masters/CN=kubernetes-admin" clientAuth
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
  issue controller-manager "/CN=system:kube-controller-manager" clientAuth
  issue scheduler "/CN=system:kube-scheduler" clientAuth
  if [[ ! -f $PKI/sa.key ]]; then
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$PKI/sa.key" 2>/dev/null
    openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
}

write_kubeconfig() {  # write_kubeconfig <file> <cert name> <user> [server]: embedded data, portable
  local b64='base64 -w0'
  cat >"$1.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: ${4:-https://127.0.0.1:$API_PORT}
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
ensure_bridge() {  # the host's side of the node network; the host routes between nodes
  if [[ ! -e /sys/class/net/$NODE_BRIDGE ]]; then
    say "creating bridge $NODE_BRIDGE ($NODE_GATEWAY_IP/24)"
    ip link add "$NODE_BRIDGE" type bridge
    ip addr add "$NODE_GATEWAY_IP/24" dev "$NODE_BRIDGE"
  fi
  ip link set "$NODE_BRIDGE" up
  sysctl -qw net.ipv4.ip_forward=1
}

remove_network() {
  [[ -e /sys/class/net/$NODE_BRIDGE ]] || return 0
  say "removing bridge $NODE_BRIDGE"
  ip link del "$NODE_BRIDGE" || true
}

# ---------------------------------------------------------------- health
kc() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }

ready_nodes() {  # how many of our nodes are Ready
  kc get nodes -l accelerate-operator.io/local-node=true --request-timeout=5s \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
    2>/dev/null | grep -c True || true
}

healthy() {
  local c
  for c in "${CONTROL_PLANE[@]}" $(node_components); do pid_of "$c" >/dev/null || return 1; done
  [[ $(kc get --raw /readyz --request-timeout=5s 2>/dev/null) == ok ]] || return 1
  [[ $(ready_nodes) -ge $NODES ]] || return 1
  dns_ready
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

start_apiserver() {
  start_bg etcd "$BIN/etcd" --name local --data-dir "$C/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes 8589934592 --log-level warn

  # 0.0.0.0: pods in network namespaces reach it through the bridge IP.
  # --enable-aggregator-routing: webhooks (Kueue's) are called at their endpoints' pod IPs, which
  # the host routes, not at Service ClusterIPs, which only the nodes' kube-proxy serves.
  # --request-timeout also bounds the graceful shutdown (60s by default, held open by
  # `kubectl logs -f` streams): after SIGTERM it now exits within about 20s.
  start_bg kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --bind-address 0.0.0.0 --secure-port "$API_PORT" --advertise-address "$NODE_GATEWAY_IP" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --authorization-mode Node,RBAC --allow-privileged=true \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --enable-aggregator-routing=true \
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
}

start_nodes() {
  local i
  for ((i = 0; i < NODES; i++)); do node_start_runtime "$i"; done
  for ((i = 0; i < NODES; i++)); do
    wait_until 60 "containerd on $(node_name "$i")" containerd_ready "$i"
  done
  # The sandbox and DNS images must be in every node before its kubelet starts pods.
  "$ROOT/hack/load-images.sh" "$PAUSE_IMAGE" "$COREDNS_IMAGE" >&2
  # Pinned, as containerd pins the sandbox image it pulls itself: the kubelet's image garbage
  # collection (a disk past 85 %) never removes it, which would leave every new pod of the
  # node in FailedCreatePodSandBox (the image comes from no registry).
  for ((i = 0; i < NODES; i++)); do
    ctr -a "$(node_socket "$i")" -n k8s.io images label "$PAUSE_IMAGE" \
      io.cri-containerd.pinned=pinned >/dev/null
  done
  for ((i = 0; i < NODES; i++)); do node_start_agents "$i"; done
}

start_nodes_and_check() { start_nodes; nodes_ready; }

record_pod_cidrs() {  # spec.podCIDR, as kind's and kubeadm's node IPAM sets it: the range the
  # node's host-local IPAM gives out (node_network routes it), so a pod's range is read from
  # its node on every cluster. Set once: the API server refuses to change it.
  local i name cidr
  for ((i = 0; i < NODES; i++)); do
    name=$(node_name "$i") cidr=$(node_pod_cidr "$i")
    [[ -n $(kc get node "$name" -o jsonpath='{.spec.podCIDR}') ]] && continue
    kc patch node "$name" --type merge \
      -p "{\"spec\": {\"podCIDR\": \"$cidr\", \"podCIDRs\": [\"$cidr\"]}}" >&2
  done
}

# ---------------------------------------------------------------- cluster DNS
dns_ready() {  # every replica Ready (one per node, hack/manifests/coredns.yaml)
  local ready
  ready=$(kc -n kube-system get deployment coredns --request-timeout=5s \
    -o jsonpath='{.status.readyReplicas}/{.spec.replicas}' 2>/dev/null) || return 1
  [[ $ready =~ ^([0-9]+)/([0-9]+)$ ]] && ((BASH_REMATCH[1] >= BASH_REMATCH[2]))
}

deploy_dns() {  # CoreDNS as a Deployment behind the kube-dns Service, as kubeadm and kind do
  # The image's ID is a pod annotation: a rebuilt image under the same tag rolls the pods.
  local image_id
  image_id=$(bah inspect --type image --format '{{.FromImageID}}' "$COREDNS_IMAGE" | cut -c1-16)
  sed -e "s|@COREDNS_IMAGE@|$COREDNS_IMAGE|" -e "s|@CLUSTER_DNS_IP@|$CLUSTER_DNS_IP|" \
    -e "s|@IMAGE_ID@|$image_id|" \
    "$ROOT/hack/manifests/coredns.yaml" | kc apply --server-side --force-conflicts -f - >&2
}

# ---------------------------------------------------------------- commands
cmd_up() {
  mkdir -p "$LOGS" "$RUN"
  BIN=$("$ROOT/hack/build-control-plane.sh" | tail -n1)
  # The quick path only when the cluster was brought up by these very scripts: after an edit
  # the full path runs, and start_bg restarts each daemon whose flags changed.
  local scripts_hash; scripts_hash=$(cat "${BASH_SOURCE[0]}" "$ROOT"/hack/lib/*.sh | sha256sum | cut -c1-16)
  if [[ -f $KUBECONFIG_OUT ]] && [[ "$(cat "$RUN/scripts.hash" 2>/dev/null)" == "$scripts_hash" ]] &&
    healthy; then
    echo "$KUBECONFIG_OUT"
    return
  fi
  ensure_tools
  local images
  images=$("$ROOT/hack/build-cluster-images.sh")
  PAUSE_IMAGE=$(sed -n 1p <<<"$images"); COREDNS_IMAGE=$(sed -n 2p <<<"$images")
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
  start_others
  wait_until 180 "$NODES Ready nodes" start_nodes_and_check
  record_pod_cidrs
  wait_until 120 "the default ServiceAccount in namespace default" default_sa
  deploy_dns
  wait_until 180 "CoreDNS (kubectl -n kube-system get pods)" dns_ready
  echo "$scripts_hash" >"$RUN/scripts.hash"
  say "cluster is up: export KUBECONFIG=$KUBECONFIG_OUT"
  echo "$KUBECONFIG_OUT"
}

cmd_down() {
  local purge=0
  [[ ${1:-} == --purge ]] && purge=1
  mkdir -p "$RUN"
  local i
  for ((i = 0; i < NODES; i++)); do node_stop "$i"; done
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
  for c in "${CONTROL_PLANE[@]}" $(node_components); do
    if pid=$(pid_of "$c"); then echo "$c: running (pid $pid)"; else echo "$c: stopped"; fi
  done
  if [[ -e /sys/class/net/$NODE_BRIDGE ]]; then echo "bridge $NODE_BRIDGE: $NODE_GATEWAY_IP/24"; else echo "bridge $NODE_BRIDGE: absent"; fi
  if pid_of kube-apiserver >/dev/null; then
    BIN=$("$ROOT/hack/build-control-plane.sh" | tail -n1)
    echo "kubeconfig: $KUBECONFIG_OUT"
    kc get nodes --request-timeout=5s 2>&1 || true
  fi
}

cmd_exec() {  # cmd_exec NODE CMD...: a shell on a node, as `docker exec` on a kind node
  local node=${1:?usage: exec NODE CMD...}; shift
  [[ $node =~ ^ao-node-([0-9]+)$ ]] || die "no node '$node' (nodes: $(node_components | awk '{print $2}' | sed 's/kubelet@//' | tr '\n' ' '))"
  [[ $# -gt 0 ]] || set -- bash
  # For a crictl of your own; `ctr -n k8s.io` (containerd's CLI) is always there.
  export CONTAINER_RUNTIME_ENDPOINT=unix:///run/containerd/containerd.sock
  in_node "${BASH_REMATCH[1]}" "$@"
}

cmd_node_kill() {  # cmd_node_kill NODE: a power loss; `up` starts the node again
  local node=${1:?usage: node-kill NODE} c pid i
  [[ $node =~ ^ao-node-([0-9]+)$ ]] || die "no node '$node'"
  i=${BASH_REMATCH[1]}
  # A node without power says nothing more: its link goes first (no FIN or RST from the sockets
  # of the processes killed below), and packets to its pods vanish (no ICMP either), so its
  # peers' connections hang, as at a real loss. `up` links and routes the node again.
  ip route replace blackhole "$(node_pod_cidr "$i")"
  ip link set "aon$i" down 2>/dev/null || true
  # Then SIGKILL, every agent at once: nothing of the node says goodbye to the API server.
  for c in kubelet kube-proxy containerd; do
    if pid=$(pid_of "$c@$node"); then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  node_stop "$i"
  ip route replace blackhole "$(node_pod_cidr "$i")"
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
  exec) shift; cmd_exec "$@" ;;
  node-kill) shift; lock; cmd_node_kill "$@" ;;
  *) echo "usage: $0 up | down [--purge] | status | exec NODE CMD... | node-kill NODE" >&2
     exit 2 ;;
esac
