# Sourced by hack/local-cluster.sh: the local cluster's nodes. Each node is what a kind node is,
# without Docker: its own network namespace (an IP on the host bridge, a pod CIDR routed to it),
# its own mount namespace (so its kubelet, containerd, CNI and logs use the standard paths
# /var/lib/kubelet, /var/lib/containerd, /run/containerd, /etc/cni/net.d, /var/log without seeing
# another node's), its own cgroup root, and in it a real containerd + runc, kubelet and kube-proxy.
#
# Needs from the caller: C, PKI, RUN, LOGS, BIN, NODES, SERVICE_CIDR, CLUSTER_DNS_IP, API_PORT,
# NODE_BRIDGE, NODE_GATEWAY_IP, POD_CIDR, PAUSE_IMAGE, and the functions start_bg, stop_one,
# pid_of, issue, write_kubeconfig, say, die.

NODE_RUN=/run/accelerate-operator   # sockets and namespace files: tmpfs, gone at reboot

node_name() { echo "ao-node-$1"; }
node_ip() { echo "10.240.0.$((10 + $1))"; }
node_pod_cidr() { echo "10.244.$(($1 + 1)).0/24"; }
node_dir() { echo "$C/nodes/$(node_name "$1")"; }
node_mnt() { echo "$NODE_RUN/$(node_name "$1").mnt"; }
node_socket() { echo "$NODE_RUN/$(node_name "$1")/containerd/containerd.sock"; }

# in_node I CMD...: run CMD inside node I's network and mount namespaces (`docker exec` for kind).
in_node() {
  local i=$1; shift
  nsenter --mount="$(node_mnt "$i")" --net="/run/netns/$(node_name "$i")" -- "$@"
}

node_pki() {  # client certs for the kubelet (Node authorizer) and kube-proxy, a serving cert
  local i=$1 name; name=$(node_name "$i")
  issue "kubelet-$name" "/O=system:nodes/CN=system:node:$name" clientAuth
  issue "kubelet-serving-$name" "/CN=$name" serverAuth "IP:$(node_ip "$i"),DNS:$name"
  issue kube-proxy "/CN=system:kube-proxy" clientAuth
}

node_network() {  # the node's namespace, its address on the bridge, and routes to its pods
  local i=$1 name ip host_if; name=$(node_name "$i"); ip=$(node_ip "$i"); host_if="aon$i"
  [[ -e /run/netns/$name ]] || ip netns add "$name"
  if [[ ! -e /sys/class/net/$host_if ]]; then
    ip link add "$host_if" type veth peer name eth0 netns "$name"
  fi
  ip link set "$host_if" master "$NODE_BRIDGE" up
  ip -n "$name" addr replace "$ip/24" dev eth0
  ip -n "$name" link set lo up
  ip -n "$name" link set eth0 up
  ip -n "$name" route replace default via "$NODE_GATEWAY_IP"
  # The host routes each node's pod CIDR to that node, as a cloud VPC would.
  ip route replace "$(node_pod_cidr "$i")" via "$ip"
  ip netns exec "$name" sysctl -qw net.ipv4.ip_forward=1
  # Service traffic between two pods on one node's bridge must pass iptables (kube-proxy's DNAT).
  ip netns exec "$name" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
}

node_mounts() {  # a mount namespace in which the standard paths are this node's own folders
  local i=$1 dir mnt run; dir=$(node_dir "$i"); mnt=$(node_mnt "$i"); run="$NODE_RUN/$(node_name "$i")"
  if findmnt -n "$mnt" >/dev/null 2>&1; then return; fi
  mkdir -p "$dir"/{kubelet,log,containerd,cni,cni-state} "$run"/{containerd,netns} \
    /var/lib/kubelet /var/log /var/lib/containerd /run/containerd /etc/cni/net.d /var/lib/cni /run/netns
  # A namespace file can only be bind-mounted under a private mount.
  if ! findmnt -n "$NODE_RUN" >/dev/null 2>&1; then
    mount --bind "$NODE_RUN" "$NODE_RUN"
    mount --make-private "$NODE_RUN"
  fi
  touch "$mnt"
  # slave: the host's later mounts still reach the node; the node's never reach the host.
  unshare --mount="$mnt" --propagation slave true
  nsenter --mount="$mnt" -- sh -euc '
    mount --bind "$1/kubelet" /var/lib/kubelet
    mount --bind "$1/log" /var/log
    mount --bind "$1/containerd" /var/lib/containerd
    mount --bind "$1/cni" /etc/cni/net.d
    mount --bind "$1/cni-state" /var/lib/cni
    mount --bind "$2/containerd" /run/containerd
    mount --bind "$2/netns" /run/netns
  ' sh "$dir" "$run"
}

cgroup_v2() { [[ -e /sys/fs/cgroup/cgroup.controllers ]]; }  # unified (Ubuntu 22.04+), or v1

node_cgroup_dirs() {  # the node's cgroup root: one folder (v2), or one in each hierarchy (v1)
  local name; name=$(node_name "$1")
  if cgroup_v2; then echo "/sys/fs/cgroup/$name"; return; fi
  local h
  for h in /sys/fs/cgroup/*/; do [[ -e $h/cgroup.procs ]] && echo "$h$name"; done
}

node_cgroups() {  # the kubelet's cgroupRoot must exist (in every hierarchy, with cgroup v1)
  local i=$1 name h c; name=$(node_name "$i")
  if cgroup_v2; then
    # Every controller the host has, handed down to the node's root (the kubelet's cgroup
    # manager enables them below it).
    mkdir -p "/sys/fs/cgroup/$name"
    for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
      echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
      echo "+$c" >"/sys/fs/cgroup/$name/cgroup.subtree_control" 2>/dev/null || true
    done
    return
  fi
  for h in /sys/fs/cgroup/*/; do
    [[ -e $h/cgroup.procs ]] || continue
    mkdir -p "$h$name"
    if [[ -e $h/cpuset.cpus && -z $(tr -d '\n' <"$h$name/cpuset.cpus") ]]; then
      cat "$h/cpuset.cpus" >"$h$name/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h$name/cpuset.mems"
    fi
  done
}

put() {  # put FILE: stdin into FILE, only if it differs (kube-proxy exits when its config is written)
  local tmp="$1.tmp"
  cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}

node_configs() {
  local i=$1 name ip dir; name=$(node_name "$i"); ip=$(node_ip "$i"); dir=$(node_dir "$i")
  local server="https://$NODE_GATEWAY_IP:$API_PORT"
  write_kubeconfig "$dir/kubelet.kubeconfig" "kubelet-$name" "system:node:$name" "$server"
  write_kubeconfig "$dir/kube-proxy.kubeconfig" kube-proxy system:kube-proxy "$server"

  put "$dir/containerd.toml" <<EOF
version = 2
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # Processes here lack CAP_SYS_RESOURCE: runc could not lower oom_score_adj below its own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "/etc/cni/net.d"
EOF

  put "$dir/cni/10-ao-bridge.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "ao-pods",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$(node_pod_cidr "$i")"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF

  # Pods resolve cluster names through CoreDNS; the host's own search domains stay out.
  grep -E '^nameserver' /etc/resolv.conf >"$dir/resolv.conf" 2>/dev/null || true
  put "$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
readOnlyPort: 0
tlsCertFile: $PKI/kubelet-serving-$name.crt
tlsPrivateKeyFile: $PKI/kubelet-serving-$name.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /$name
failSwapOn: false
clusterDNS: [$CLUSTER_DNS_IP]
clusterDomain: cluster.local
resolvConf: $dir/resolv.conf
# Images are loaded, never pulled: nothing may garbage-collect them, and the shared disk's
# fill level is no reason to evict a test's pods.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
serializeImagePulls: false
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
fileCheckFrequency: 10s
shutdownGracePeriod: 0s
EOF

  put "$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
hostnameOverride: $name
mode: iptables
clusterCIDR: $POD_CIDR
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# 0: leave the host's conntrack table size and timeouts alone (shared by every node here).
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {minSyncPeriod: 0s}
EOF
}

node_start_runtime() {  # namespaces, cgroups, configs, then containerd (images load next)
  local i=$1 name; name=$(node_name "$i")
  node_pki "$i"
  node_network "$i"
  node_mounts "$i"
  node_cgroups "$i"
  node_configs "$i"
  start_bg "containerd@$name" nsenter --mount="$(node_mnt "$i")" --net="/run/netns/$name" -- \
    containerd --config "$(node_dir "$i")/containerd.toml"
}

node_start_agents() {  # kubelet and kube-proxy
  local i=$1 name dir; name=$(node_name "$i"); dir=$(node_dir "$i")
  start_bg "kubelet@$name" nsenter --mount="$(node_mnt "$i")" --net="/run/netns/$name" -- \
    "$BIN/kubelet" --config "$dir/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
    --hostname-override "$name" --node-ip "$(node_ip "$i")" \
    --node-labels "accelerate-operator.io/local-node=true" --v=1
  start_bg "kube-proxy@$name" nsenter --mount="$(node_mnt "$i")" --net="/run/netns/$name" -- \
    "$BIN/kube-proxy" --config "$dir/kube-proxy.yaml" --v=1
}

containerd_ready() { [[ -S $(node_socket "$1") ]] && ctr -a "$(node_socket "$1")" version >/dev/null 2>&1; }

kill_cgroup_tree() {  # SIGKILL every process in a cgroup subtree (containers of a node)
  local dir=$1 f pid
  [[ -d $dir ]] || return 0
  while IFS= read -r f; do
    while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$f"
  done < <(find "$dir" -name cgroup.procs)
}

node_stop() {
  local i=$1 name h pid; name=$(node_name "$i")
  stop_one "kubelet@$name" 10
  stop_one "kube-proxy@$name" 5
  stop_one "containerd@$name" 10
  # The containers and their shims outlive containerd: end them by cgroup and by namespace.
  local pids_dir=/sys/fs/cgroup/pids/$name d
  cgroup_v2 && pids_dir=/sys/fs/cgroup/$name
  kill_cgroup_tree "$pids_dir"
  if [[ -e /run/netns/$name ]]; then
    for pid in $(ip netns pids "$name" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  fi
  sleep 0.2
  kill_cgroup_tree "$pids_dir"
  for d in $(node_cgroup_dirs "$i"); do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  # With no process left in it, unmounting the namespace file frees every mount made inside.
  umount -l "$(node_mnt "$i")" 2>/dev/null || true
  rm -f "$(node_mnt "$i")"
  ip route del "$(node_pod_cidr "$i")" 2>/dev/null || true
  ip link del "aon$i" 2>/dev/null || true
  ip netns del "$name" 2>/dev/null || true
}
