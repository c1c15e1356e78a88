#!/bin/sh
# podnet: the pod network of a kind node built by hack/build-kind-node.sh, doing kindnetd's job
# for nodes on one L2 network (kind's Docker network): this node's CNI config (ptp and host-local
# over the node's podCIDR, portmap), a route to every other node's podCIDR through that node's
# address, and masquerade for pod traffic that leaves the pod subnet. It stands in for kindnetd,
# which no registry we can reach serves (neither its image nor its Go module); released kind node
# images keep kindnetd. Runs in a hostNetwork DaemonSet (hack/kind/default-cni.yaml).
set -eu
: "${NODE_NAME:?}" "${POD_SUBNET:?}"
sa=/var/run/secrets/kubernetes.io/serviceaccount

kc() {  # kubectl as this pod's service account; at kind's CONTROL_PLANE_ENDPOINT when set, so
        # the API server is reached before kube-proxy serves its Service address
  if [ -n "${CONTROL_PLANE_ENDPOINT:-}" ]; then
    kubectl --server="https://$CONTROL_PLANE_ENDPOINT" --certificate-authority="$sa/ca.crt" \
      --token="$(cat "$sa/token")" "$@"
  else
    kubectl "$@"
  fi
}

conf=/etc/cni/net.d/10-podnet.conflist
mtu=$(cat /sys/class/net/eth0/mtu)

write_conf() {  # write_conf CIDR, only when it changes: containerd reloads on every write
  cat >"$conf.tmp" <<JSON
{"cniVersion": "0.3.1", "name": "podnet", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": $mtu,
   "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
            "routes": [{"dst": "0.0.0.0/0"}], "ranges": [[{"subnet": "$1"}]]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
  if cmp -s "$conf.tmp" "$conf"; then rm -f "$conf.tmp"; else mv "$conf.tmp" "$conf"; fi
}

masquerade="-s $POD_SUBNET ! -d $POD_SUBNET -j MASQUERADE"
# shellcheck disable=SC2086  # the rule is words
iptables -t nat -C POSTROUTING $masquerade 2>/dev/null || iptables -t nat -A POSTROUTING $masquerade
while :; do
  if kc get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' >/tmp/nodes; then
    while read -r name cidr ip _; do
      if [ -z "$cidr" ] || [ -z "$ip" ]; then continue; fi
      if [ "$name" = "$NODE_NAME" ]; then write_conf "$cidr"; else ip route replace "$cidr" via "$ip"; fi
    done </tmp/nodes
  fi
  sleep 5
done
