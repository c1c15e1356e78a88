"""Pod networking for the local node agent: a host bridge, one veth per pod, a sandbox process.

Each pod gets a "sandbox": `unshare --net --uts sleep infinity`, which owns the pod's network and
UTS namespaces for the pod's whole life (containers join it, so container restarts keep the IP).
We deliberately do not use named namespaces (`ip netns add`): each one is a bind mount under
/run/netns that every later mount namespace copies, which grows quadratically with 1000 pods.
The netns, and with it the veth pair, disappear when the last process in it exits.

A Linux bridge holds at most 1024 ports, so pods spill over to chained bridges (ao-br1, ...),
joined to ao-br0 by a veth pair: one L2 segment, one subnet, one gateway (the bridge IP).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import threading

PORTS_PER_BRIDGE = 1000


def run_ip(args: list[str], batch: str | None = None, netns_pid: int | None = None) -> None:
    cmd = ["ip", *args]
    if batch is not None:
        cmd = ["ip", "-batch", "-"]
    if netns_pid is not None:
        cmd = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *cmd]
    r = subprocess.run(cmd, input=batch, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()} (batch: {batch!r})")


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


class PodNetwork:
    """Allocates pod IPs and wires sandboxes to the bridge. Thread-safe."""

    def __init__(self, bridge: str, cidr: str):
        self.bridge = bridge
        self.iface = ipaddress.ip_interface(cidr)  # e.g. 10.244.0.1/16: the gateway
        self.gateway = str(self.iface.ip)
        self.prefix = self.iface.network.prefixlen
        self._lock = threading.Lock()
        self._used: set[str] = {self.gateway}
        self._next = int(self.iface.ip) + 1
        self.ensure_bridge(0)

    def _bridge_name(self, i: int) -> str:
        return self.bridge if i == 0 else f"{self.bridge[:-1]}{i}" if self.bridge[-1].isdigit() \
            else f"{self.bridge}{i}"

    def ensure_bridge(self, i: int) -> str:
        name = self._bridge_name(i)
        if link_exists(name):
            return name
        lines = [f"link add {name} type bridge"]
        if i == 0:
            lines.append(f"addr add {self.iface} dev {name}")
        else:
            # Chain to the first bridge so every pod stays on one L2 segment.
            a, b = f"aol{i}a", f"aol{i}b"
            lines += [f"link add {a} type veth peer name {b}",
                      f"link set {a} master {self._bridge_name(0)}", f"link set {a} up",
                      f"link set {b} master {name}", f"link set {b} up"]
        lines.append(f"link set {name} up")
        run_ip([], batch="\n".join(lines) + "\n")
        return name

    def _pick_bridge(self) -> str:
        i = 0
        while True:
            name = self.ensure_bridge(i)
            if len(os.listdir(f"/sys/class/net/{name}/brif")) < PORTS_PER_BRIDGE:
                return name
            i += 1

    def reserve(self, ip: str) -> None:
        with self._lock:
            self._used.add(ip)

    def allocate(self) -> str:
        with self._lock:
            net = self.iface.network
            for _ in range(net.num_addresses):
                if self._next >= int(net.broadcast_address):
                    self._next = int(net.network_address) + 2
                ip = str(ipaddress.ip_address(self._next))
                self._next += 1
                if ip not in self._used:
                    self._used.add(ip)
                    return ip
        raise RuntimeError(f"no free pod IP left in {self.iface.network}")

    def release(self, ip: str | None) -> None:
        with self._lock:
            self._used.discard(ip)

    def attach(self, sandbox_pid: int, ip: str, veth: str) -> None:
        """Create veth `veth` <-> eth0 in the sandbox's netns, address it, default route."""
        with self._lock:  # bridge port counting and creation must not race
            bridge = self._pick_bridge()
            if link_exists(veth):  # left over from a crashed agent
                run_ip(["link", "del", veth])
            run_ip([], batch=(f"link add {veth} type veth peer name eth0 netns {sandbox_pid}\n"
                              f"link set {veth} master {bridge}\nlink set {veth} up\n"))
        run_ip([], netns_pid=sandbox_pid, batch=(
            f"addr add {ip}/{self.prefix} dev eth0\nlink set eth0 up\nlink set lo up\n"
            f"route add default via {self.gateway}\n"))

    def bridges(self) -> list[str]:
        return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(self.bridge[:-1]))
