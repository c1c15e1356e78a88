"""LOCAL NODE AGENT: dev/test infrastructure that stands in for the kubelet on a local cluster.

This is NOT a kubelet and NOT a container runtime. It registers fake Nodes, and runs every pod
bound to them as plain host processes: a container's `command`+`args` run with the HOST's
filesystem and the project's Python virtual environment first on PATH; the container image is
never pulled or run (a container without `command` fails with a message saying so). What it does
provide, so that the operator's multi-node jobs behave as on a real cluster:

* a network namespace per pod (own IP on the host bridge, so several pods can listen on 29500),
  a UTS namespace (hostname) and a private mount namespace per container;
* volumes (configMap, secret, projected service-account token, downwardAPI, emptyDir, hostPath,
  persistentVolumeClaim: it provisions a hostPath PV for each unbound claim without a storage
  class) bind-mounted at their mountPaths, /etc/hosts with the namespace's
  `<host>.<subdomain>` names, the termination-message file;
* real pod status (phases, container states, restarts), graceful deletion, node Leases;
* `kubectl logs [-f]` through a minimal kubelet HTTPS endpoint per node.

It ignores probes, resource limits, activeDeadlineSeconds, security contexts and images.
Run it as root with the project venv's Python; see hack/local-cluster.sh.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import heapq
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kubeclient import ApiError, KubeClient  # noqa: E402
from kubelet_server import serve_kubelet_api  # noqa: E402
from network import PodNetwork  # noqa: E402
from podfiles import NotReady, build_env, expand, hosts_file, prepare_volumes  # noqa: E402

log = logging.getLogger("local-node-agent")
HERE = os.path.dirname(os.path.abspath(__file__))
CONTAINER_INIT = os.path.join(HERE, "container_init.py")
HOST_IP = "127.0.0.1"
VERSION = "v1.34.4-local-node-agent"
TERMINAL = ("Succeeded", "Failed")
PASS_ENV = ("LANG", "LC_ALL", "TZ", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE", "HF_DATASETS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def proc_starttime(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_group(pid: int, sig: int) -> None:
    # Containers are session leaders (start_new_session), so their pid is their group id.
    for fn in (os.killpg, os.kill):
        try:
            fn(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Timers:
    """One thread running delayed callbacks (restart backoff, SIGKILL after grace period)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = 0
        threading.Thread(target=self._run, name="timers", daemon=True).start()

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, self._seq, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                log.exception("timer callback failed")


class Reaper:
    """Waits for child exits with pidfds in one epoll loop (no thread per process)."""

    def __init__(self, dispatch: Callable[[Callable[[], None]], None]) -> None:
        self._ep = select.epoll()
        self._procs: dict[int, tuple[subprocess.Popen, Callable[[int], None] | None]] = {}
        self._lock = threading.Lock()
        self._dispatch = dispatch
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def watch(self, proc: subprocess.Popen, on_exit: Callable[[int], None] | None) -> None:
        fd = os.pidfd_open(proc.pid)
        with self._lock:
            self._procs[fd] = (proc, on_exit)
        self._ep.register(fd, select.EPOLLIN)

    def _run(self) -> None:
        while True:
            for fd, _ in self._ep.poll():
                with self._lock:
                    proc, on_exit = self._procs.pop(fd)
                self._ep.unregister(fd)
                os.close(fd)
                code = proc.wait()
                code = 128 - code if code < 0 else code  # killed by signal N: 128+N
                if on_exit is not None:
                    self._dispatch(lambda cb=on_exit, c=code: cb(c))


class Container:
    def __init__(self, spec: dict, init: bool):
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.restart_count = 0
        self.restart_pending = False
        self.terminated: dict | None = None  # state.terminated of the last run
        self.last_terminated: dict | None = None
        self.waiting: tuple[str, str] | None = None


class PodRecord:
    def __init__(self, pod: dict, pods_dir: str):
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.name: str = meta["name"]
        self.pod = pod
        self.dir = os.path.join(pods_dir, f"{self.ns}_{self.name}_{self.uid}")
        self.lock = threading.RLock()
        self.status_lock = threading.Lock()
        self.state = "new"  # new, starting, running, finished, gone
        self.deleting = False
        self.ip: str | None = None
        self.sandbox: subprocess.Popen | None = None
        self.veth = "aov" + self.uid.replace("-", "")[:12]
        self.start_time: str | None = None
        self.initialized = False
        self.init_proc: subprocess.Popen | None = None
        self.containers = {c["name"]: Container(c, False) for c in pod["spec"]["containers"]}
        self.init_containers = {c["name"]: Container(c, True)
                                for c in pod["spec"].get("initContainers") or []}
        self.pod_failure: tuple[str, str] | None = None  # (reason, message) of a pod-level failure
        self.last_status: str | None = None
        self.volumes: dict[str, str] = {}

    @property
    def spec(self) -> dict:
        return self.pod["spec"]

    @property
    def dns_name(self) -> tuple[str, str] | None:
        s = self.spec
        return (s["hostname"], s["subdomain"]) if s.get("hostname") and s.get("subdomain") else None

    def live(self) -> list[Container]:
        return [c for c in self.containers.values() if c.proc is not None and c.proc.poll() is None]


class Agent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.client = KubeClient(args.kubeconfig)
        self.node_names = [f"{args.node_prefix}{i}" for i in range(args.nodes)]
        self.pods_dir = os.path.join(args.state_dir, "pods")
        os.makedirs(self.pods_dir, exist_ok=True)
        self.net = PodNetwork(args.bridge, args.bridge_cidr)
        self.allocatable = {"cpu": args.cpu, "memory": args.memory, "pods": str(args.max_pods),
                            "ephemeral-storage": "100Gi"}
        self.records: dict[str, PodRecord] = {}
        self.gone: OrderedDict[str, None] = OrderedDict()  # uids already finalised
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(args.workers, "pod-worker")
        self.timers = Timers()
        self.reaper = Reaper(self.submit)
        self.hosts_dirty: set[str] = set()
        self.hosts_cv = threading.Condition()
        self.stopping = threading.Event()
        self.started_at = now()
        venv_bin = args.venv_bin or os.path.dirname(sys.executable)
        self.base_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        self.base_env.update({
            "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "VIRTUAL_ENV": os.path.dirname(venv_bin), "HOME": os.environ.get("HOME", "/root"),
            "KUBERNETES_SERVICE_HOST": self.net.gateway, "KUBERNETES_SERVICE_PORT": "6443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "6443",
            "KUBERNETES_PORT": f"tcp://{self.net.gateway}:6443",
            "KUBERNETES_PORT_443_TCP": f"tcp://{self.net.gateway}:6443",
            "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
            "KUBERNETES_PORT_443_TCP_ADDR": self.net.gateway,
            "KUBERNETES_PORT_443_TCP_PORT": "6443",
        })

    def submit(self, fn: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                fn()
            except Exception:
                log.exception("pod worker task failed")
        self.pool.submit(guarded)

    # ---------------------------------------------------------------- nodes
    def node_port(self, i: int) -> int:
        return self.args.port_base + i

    def register_nodes(self) -> None:
        for i, name in enumerate(self.node_names):
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", "node.kubernetes.io/local-node-agent": "true"}
            body = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": labels}, "spec": {}}
            while True:
                try:
                    try:
                        self.client.post("/api/v1/nodes", body)
                    except ApiError as e:
                        if e.status != 409:
                            raise
                        self.client.merge_patch(f"/api/v1/nodes/{name}",
                                                {"metadata": {"labels": labels}})
                    self.post_node_status(i, name)
                    break
                except Exception as e:
                    log.warning("registering node %s failed (%s); retrying", name, e)
                    time.sleep(2)
        log.info("registered nodes %s", ", ".join(self.node_names))

    def post_node_status(self, i: int, name: str) -> None:
        t, since = now(), self.started_at
        conds = [{"type": typ, "status": "False", "reason": f"KubeletHas{rs}",
                  "message": "local node agent", "lastHeartbeatTime": t,
                  "lastTransitionTime": since} for typ, rs in
                 (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                  ("PIDPressure", "SufficientPID"))]
        conds.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                      "message": "local node agent is posting ready status",
                      "lastHeartbeatTime": t, "lastTransitionTime": since})
        status = {
            "capacity": self.allocatable, "allocatable": self.allocatable, "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": HOST_IP},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.node_port(i)}},
            "nodeInfo": {"machineID": name, "systemUUID": name, "bootID": name,
                         "kernelVersion": os.uname().release, "osImage": "host (local node agent)",
                         "containerRuntimeVersion": "local://0", "kubeletVersion": VERSION,
                         "kubeProxyVersion": VERSION, "operatingSystem": "linux",
                         "architecture": "amd64"},
        }
        self.client.merge_patch(f"/api/v1/nodes/{name}/status", {"status": status})

    def renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro_now()}
        try:
            self.client.merge_patch(path, {"spec": spec})
        except ApiError as e:
            if e.status != 404:
                raise
            node = self.client.get(f"/api/v1/nodes/{name}")
            self.client.post(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": name, "namespace": "kube-node-lease",
                              "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                   "name": name,
                                                   "uid": node["metadata"]["uid"]}]},
                 "spec": spec})

    def heartbeat_loop(self) -> None:
        # Status every beat too (two small PATCHes): after an outage the node lifecycle
        # controller sets Ready=Unknown and only the node's own status post flips it back.
        while not self.stopping.wait(self.args.lease_interval):
            for i, name in enumerate(self.node_names):
                try:
                    self.renew_lease(name)
                    self.post_node_status(i, name)
                except ApiError as e:
                    if e.status == 404:  # node deleted under us (e.g. by a test): re-register
                        self.register_nodes()
                    log.warning("heartbeat for %s failed: %s", name, e)
                except Exception as e:
                    log.warning("heartbeat for %s failed: %s", name, e)

    # ---------------------------------------------------------------- watch
    def watch_loop(self) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                lst = self.client.get("/api/v1/pods")
                rv = lst["metadata"]["resourceVersion"]
                seen = set()
                for pod in lst["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self.on_pod(pod)
                with self.lock:
                    vanished = [u for u in self.records if u not in seen]
                for uid in vanished:
                    self.on_pod_deleted(uid)
                backoff = 1.0
                while not self.stopping.is_set():
                    for ev in self.client.watch("/api/v1/pods", rv):
                        obj = ev["object"]
                        if ev["type"] == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", ""))
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] == "DELETED":
                            self.on_pod_deleted(obj["metadata"]["uid"])
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            self.on_pod(obj)
            except Exception as e:
                if self.stopping.is_set():
                    return
                level = logging.INFO if isinstance(e, ApiError) and e.status == 410 else \
                    logging.WARNING
                log.log(level, "pod watch interrupted (%s); relisting in %.0fs", e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5)

    def on_pod(self, pod: dict) -> None:
        if pod["spec"].get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            if uid in self.gone:
                return
            rec = self.records.get(uid)
            new = rec is None
            if new:
                rec = self.records[uid] = PodRecord(pod, self.pods_dir)
                if pod.get("status", {}).get("phase") in TERMINAL:
                    rec.state = "finished"  # never restart a terminal pod (agent restart)
                    rec.last_status = "adopted"
        with rec.lock:
            rec.pod = pod
            if pod["metadata"].get("deletionTimestamp") and not rec.deleting:
                rec.deleting = True
                self.submit(lambda: self.terminate(rec))
            elif new and rec.state == "new":
                self.submit(lambda: self.start_pod(rec))

    def on_pod_deleted(self, uid: str) -> None:
        with self.lock:
            rec = self.records.get(uid)
        if rec is None:
            return
        with rec.lock:
            rec.deleting = True
            for c in rec.live():
                kill_group(c.proc.pid, signal.SIGKILL)
            if rec.init_proc is not None:
                kill_group(rec.init_proc.pid, signal.SIGKILL)
            busy = rec.state == "starting"
        if not busy:
            self.submit(lambda: self.finalize(rec, delete=False))

    # ---------------------------------------------------------------- pod lifecycle
    def _kill_stale(self, rec: PodRecord) -> bool:
        """Kill processes a previous agent started for this pod; True if it had started any."""
        path = os.path.join(rec.dir, "state.json")
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return False
        for pid, start in state.get("pids", []):
            if proc_starttime(pid) == start:
                kill_group(pid, signal.SIGKILL)
        os.unlink(path)
        return bool(state.get("pids"))

    def _record_pid(self, rec: PodRecord, pid: int) -> None:
        path = os.path.join(rec.dir, "state.json")
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {"pids": []}
        state["pids"].append([pid, proc_starttime(pid)])
        with open(path, "w") as f:
            json.dump(state, f)

    def start_pod(self, rec: PodRecord) -> None:
        with rec.lock:
            if rec.state not in ("new",):
                return  # finalized (deleted) or already started by an earlier task
            if rec.deleting:
                self.submit(lambda: self.finalize(rec))
                return
            rec.state = "starting"
        try:
            self._start_pod(rec)
        except NotReady as e:
            with rec.lock:
                for c in rec.containers.values():
                    c.waiting = (e.reason, e.message)
                rec.state = "new"
                deleting = rec.deleting
            if deleting:
                self.finalize(rec)
                return
            log.info("pod %s/%s not ready to start: %s", rec.ns, rec.name, e.message)
            self.report(rec)
            self.timers.later(2, lambda: self.submit(lambda: self.start_pod(rec)))
        except Exception as e:
            if not isinstance(e, _PodDone):
                log.exception("starting pod %s/%s failed", rec.ns, rec.name)
            with rec.lock:
                if rec.pod_failure is None:
                    rec.pod_failure = ("StartError",
                                       f"the local node agent could not start the pod: {e}")
                for c in rec.containers.values():
                    if c.proc is None and c.terminated is None:
                        c.terminated = {"exitCode": 128, "reason": "StartError",
                                        "message": rec.pod_failure[1], "startedAt": now(),
                                        "finishedAt": now(), "containerID": "local://0"}
                rec.state = "finished"
                deleting = rec.deleting
            self._teardown_sandbox(rec)
            if deleting:
                self.finalize(rec)
            else:
                self.report(rec)

    def _start_pod(self, rec: PodRecord) -> None:
        os.makedirs(rec.dir, exist_ok=True)
        status = rec.pod.get("status") or {}
        if rec.start_time is None:
            had_processes = self._kill_stale(rec)
            started_before = any("running" in (cs.get("state") or {}) or
                                 "terminated" in (cs.get("state") or {})
                                 for cs in status.get("containerStatuses") or [])
            if had_processes or started_before:
                # Adopting a pod a previous agent ran: its processes are gone.
                if rec.spec.get("restartPolicy", "Always") == "Never":
                    raise RuntimeError("the local node agent restarted and lost this pod's "
                                       "processes (restartPolicy Never: not restarted)")
                for cs in status.get("containerStatuses") or []:
                    if cs["name"] in rec.containers:
                        rec.containers[cs["name"]].restart_count = cs.get("restartCount", 0) + 1
                rec.initialized = True
            rec.start_time = status.get("startTime") or now()
        if rec.ip is None:
            if rec.spec.get("hostNetwork"):
                rec.ip = HOST_IP
            else:
                rec.ip = status.get("podIP") or self.net.allocate()
                self.net.reserve(rec.ip)
        if rec.sandbox is None and not rec.spec.get("hostNetwork"):
            sb = subprocess.Popen(["unshare", "--net", "--uts", "--", "sh", "-c",
                                   "echo ready; exec sleep infinity"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
            sb.stdout.readline()  # the namespaces exist once sh runs
            sb.stdout.close()
            rec.sandbox = sb
            self._record_pid(rec, sb.pid)
            self.reaper.watch(sb, None)
            self.net.attach(sb.pid, rec.ip, rec.veth)
        voldir = os.path.join(rec.dir, "volumes")
        volumes = prepare_volumes(self.client, rec.pod, voldir, rec.ip, HOST_IP, self.allocatable)
        self.write_hosts(rec)
        if rec.dns_name:
            self.mark_hosts_dirty(rec.ns)
        if not rec.initialized:
            for c in rec.init_containers.values():
                while True:
                    with rec.lock:
                        if rec.deleting:
                            raise RuntimeError("pod deleted while starting")
                        proc = self.spawn(rec, c, volumes)
                        rec.init_proc = proc
                    self.report(rec)
                    code = proc.wait()
                    code = 128 - code if code < 0 else code
                    with rec.lock:
                        rec.init_proc = None
                        self._record_exit(rec, c, code)
                    if code == 0:
                        break
                    if rec.spec.get("restartPolicy", "Always") == "Never" or rec.deleting:
                        rec.pod_failure = ("InitContainerFailed",
                                           f"init container {c.name} exited with {code}")
                        raise _PodDone()
                    c.restart_count += 1
                    time.sleep(min(2 ** c.restart_count, 30))
            rec.initialized = True
        with rec.lock:
            if rec.deleting:
                raise RuntimeError("pod deleted while starting")
            for c in rec.containers.values():
                c.waiting = None
                self._start_container(rec, c, volumes)
            rec.state = "running"
            rec.volumes = volumes
        self.report(rec)

    def _start_container(self, rec: PodRecord, c: Container, volumes: dict[str, str]) -> None:
        try:
            proc = self.spawn(rec, c, volumes)
        except NotReady:
            raise
        except Exception as e:  # no command, bad mount: the container fails, the pod goes on
            c.started_at = now()
            self._record_exit(rec, c, 128, message=str(e), reason="StartError")
            self.timers.later(0, lambda: self.submit(lambda: self.after_exit(rec, c)))
            return
        self.reaper.watch(proc, lambda code: self.on_exit(rec, c, code))

    def spawn(self, rec: PodRecord, c: Container, volumes: dict[str, str]) -> subprocess.Popen:
        spec = c.spec
        if not spec.get("command"):
            raise ValueError(
                f"container {c.name!r} has no command: the local node agent runs commands on "
                f"the host and cannot use the entrypoint of image {spec.get('image')!r}; "
                f"set `command` (and `args`)")
        base = {**self.base_env, "HOSTNAME": self.hostname(rec)}
        env = build_env(self.client, rec.pod, spec, base, rec.ip, HOST_IP, self.allocatable)
        argv = [expand(a, env) for a in spec["command"] + (spec.get("args") or [])]
        term_host = os.path.join(rec.dir, f"{c.name}.termination-log")
        open(term_host, "w").close()
        mounts = []
        for vm in spec.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise ValueError(f"volumeMount {vm['name']!r} names no volume of the pod")
            src = volumes[vm["name"]]
            if vm.get("subPath"):
                src = os.path.join(src, vm["subPath"])
                if not os.path.exists(src):
                    os.makedirs(src, exist_ok=True)
            mounts.append({"src": src, "dst": vm["mountPath"], "ro": bool(vm.get("readOnly")),
                           "file": os.path.isfile(src)})
        if not rec.spec.get("hostNetwork"):
            mounts.append({"src": os.path.join(rec.dir, "hosts"), "dst": "/etc/hosts",
                           "ro": False, "file": True})
            # The host's nameserver is unreachable from a pod's network namespace: every name
            # not in /etc/hosts (a reverse lookup by gloo or torch, say) would wait for DNS
            # timeouts. There is no cluster DNS here, so lookups fail at once instead.
            resolv = os.path.join(rec.dir, "resolv.conf")
            with open(resolv, "w") as f:
                f.write(f"nameserver 127.0.0.1\nsearch {rec.ns}.svc.cluster.local "
                        "svc.cluster.local cluster.local\noptions ndots:1 timeout:1 attempts:1\n")
            mounts.append({"src": resolv, "dst": "/etc/resolv.conf", "ro": True, "file": True})
        mounts.append({"src": term_host, "file": True, "ro": False,
                       "dst": spec.get("terminationMessagePath") or "/dev/termination-log"})
        init_spec = {"argv": argv, "env": env, "cwd": spec.get("workingDir") or "/",
                     "mounts": mounts, "termination_log_host": term_host,
                     "hostname": self.hostname(rec)}
        if rec.sandbox is not None:
            init_spec["netns"] = f"/proc/{rec.sandbox.pid}/ns/net"
            init_spec["utsns"] = f"/proc/{rec.sandbox.pid}/ns/uts"
        spec_path = os.path.join(rec.dir, f"{c.name}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(init_spec, f)
        os.chmod(spec_path, 0o600)
        log_path = os.path.join(rec.dir, f"{c.name}.log")
        if c.terminated is not None and os.path.exists(log_path):
            os.replace(log_path, os.path.join(rec.dir, f"{c.name}.previous.log"))
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-I", "-S", CONTAINER_INIT, spec_path],
                                    stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        self._record_pid(rec, proc.pid)
        if c.terminated is not None:
            c.last_terminated = c.terminated
        c.terminated = None
        c.proc = proc
        c.started_at = now()
        c.restart_pending = False
        return proc

    def hostname(self, rec: PodRecord) -> str:
        return (rec.spec.get("hostname") or rec.name)[:63]

    def _record_exit(self, rec: PodRecord, c: Container, code: int, message: str = "",
                     reason: str | None = None) -> None:
        term_host = os.path.join(rec.dir, f"{c.name}.termination-log")
        if not message:
            try:
                with open(term_host, "rb") as f:
                    message = f.read(4096).decode(errors="replace")
            except OSError:
                message = ""
        if not message and code != 0 and \
                c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                with open(os.path.join(rec.dir, f"{c.name}.log"), "rb") as f:
                    f.seek(max(0, os.path.getsize(f.name) - 2048))
                    message = b"\n".join(f.read().splitlines()[-80:]).decode(errors="replace")
            except OSError:
                pass
        reason = reason or ("Completed" if code == 0 else "Error")
        c.terminated = {"exitCode": code, "reason": reason,
                        "startedAt": c.started_at or now(), "finishedAt": now(),
                        "containerID": f"local://{c.proc.pid if c.proc else 0}"}
        if message:
            c.terminated["message"] = message
        c.proc = None

    def on_exit(self, rec: PodRecord, c: Container, code: int) -> None:
        with rec.lock:
            self._record_exit(rec, c, code)
        self.after_exit(rec, c)

    def after_exit(self, rec: PodRecord, c: Container) -> None:
        with rec.lock:
            code = c.terminated["exitCode"]
            if rec.deleting:
                done = not rec.live()
            else:
                policy = rec.spec.get("restartPolicy", "Always")
                if policy == "Always" or (policy == "OnFailure" and code != 0):
                    c.restart_pending = True
                    delay = min(2 ** min(c.restart_count, 5), 30)
                    self.timers.later(delay, lambda: self.submit(lambda: self.restart(rec, c)))
                elif not rec.live() and not any(x.restart_pending for x in rec.containers.values()):
                    rec.state = "finished"
                done = False
            finished = rec.state == "finished"
        if finished:
            self._teardown_sandbox(rec)
        self.report(rec)
        if done:
            self.finalize(rec)

    def restart(self, rec: PodRecord, c: Container) -> None:
        with rec.lock:
            if rec.deleting or rec.state != "running" or not c.restart_pending:
                return
            c.restart_count += 1
            try:
                self._start_container(rec, c, rec.volumes)
            except NotReady as e:
                c.waiting = (e.reason, e.message)
                self.timers.later(5, lambda: self.submit(lambda: self.restart(rec, c)))
        self.report(rec)

    def terminate(self, rec: PodRecord) -> None:
        """Graceful deletion: SIGTERM, SIGKILL after the grace period, then finalize."""
        with rec.lock:
            if rec.state == "starting":
                if rec.init_proc is not None:
                    kill_group(rec.init_proc.pid, signal.SIGTERM)
                return  # start_pod notices `deleting` and finalizes
            live = rec.live()
            if not live:
                rec.state = "finished" if rec.state != "gone" else "gone"
            grace = rec.pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = rec.spec.get("terminationGracePeriodSeconds", 30)
            grace = min(max(int(grace), 0), 30)
            for c in live:
                kill_group(c.proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if not live:
            self.finalize(rec)
            return

        def force() -> None:
            with rec.lock:
                for c in rec.live():
                    kill_group(c.proc.pid, signal.SIGKILL)
        self.timers.later(grace, force)

    def _teardown_sandbox(self, rec: PodRecord) -> None:
        with rec.lock:
            sb, rec.sandbox = rec.sandbox, None
            ip = rec.ip if not rec.spec.get("hostNetwork") else None
        if sb is None:
            return
        # Anything still inside the pod's netns (daemons that left the container's session).
        try:
            target = os.readlink(f"/proc/{sb.pid}/ns/net")
            for p in os.listdir("/proc"):
                if p.isdigit() and int(p) != sb.pid:
                    try:
                        if os.readlink(f"/proc/{p}/ns/net") == target:
                            os.kill(int(p), signal.SIGKILL)
                    except OSError:
                        pass
        except OSError:
            pass
        kill_group(sb.pid, signal.SIGKILL)
        self.net.release(ip)
        if rec.dns_name:
            self.mark_hosts_dirty(rec.ns)

    def finalize(self, rec: PodRecord, delete: bool = True) -> None:
        with rec.lock:
            if rec.state == "gone":
                return
            rec.state = "gone"
            for c in rec.live():
                kill_group(c.proc.pid, signal.SIGKILL)
        self._teardown_sandbox(rec)
        shutil.rmtree(os.path.join(rec.dir, "volumes"), ignore_errors=True)
        try:
            os.unlink(os.path.join(rec.dir, "state.json"))
        except OSError:
            pass
        with self.lock:
            self.records.pop(rec.uid, None)
            self.gone[rec.uid] = None
            while len(self.gone) > 20000:
                self.gone.popitem(last=False)
        if delete:
            self.delete_pod(rec.ns, rec.name, rec.uid)

    def delete_pod(self, ns: str, name: str, uid: str, attempt: int = 0) -> None:
        """Remove the pod from the API (as the kubelet does once its processes are gone)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": uid}}
        try:
            self.client.delete(f"/api/v1/namespaces/{ns}/pods/{name}", body)
            return
        except ApiError as e:
            if e.status in (404, 409):
                return
            log.warning("deleting pod %s/%s failed: %s", ns, name, e)
        except Exception as e:
            log.warning("deleting pod %s/%s failed: %s", ns, name, e)
        if attempt < 100:
            self.timers.later(3, lambda: self.submit(
                lambda: self.delete_pod(ns, name, uid, attempt + 1)))

    # ---------------------------------------------------------------- status
    def _container_status(self, rec: PodRecord, c: Container) -> dict:
        spec = c.spec
        cs = {"name": c.name, "image": spec.get("image") or "none",
              "imageID": f"local://{spec.get('image') or 'none'}",
              "restartCount": c.restart_count, "ready": False, "started": False, "state": {}}
        if c.proc is not None:
            cs["state"] = {"running": {"startedAt": c.started_at}}
            cs["containerID"] = f"local://{c.proc.pid}"
            cs["ready"] = cs["started"] = not c.init
        elif c.terminated is not None and not c.restart_pending:
            cs["state"] = {"terminated": c.terminated}
            cs["containerID"] = c.terminated["containerID"]
        elif c.terminated is not None:
            cs["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message":
                                       f"back-off restarting failed container {c.name}"}}
        elif c.waiting:
            cs["state"] = {"waiting": {"reason": c.waiting[0], "message": c.waiting[1]}}
        else:
            cs["state"] = {"waiting": {"reason": "PodInitializing" if rec.init_containers
                                       and not rec.initialized else "ContainerCreating"}}
        last = c.last_terminated if c.terminated is None or not c.restart_pending else c.terminated
        if last:
            cs["lastState"] = {"terminated": last}
        return cs

    def compute_status(self, rec: PodRecord) -> dict:
        t = now()
        statuses = [self._container_status(rec, c) for c in rec.containers.values()]
        ready = all(s["ready"] for s in statuses)
        if rec.state == "finished":
            ok = rec.pod_failure is None and all(
                c.terminated is not None and c.terminated["exitCode"] == 0
                for c in rec.containers.values())
            phase = "Succeeded" if ok else "Failed"
            ready = False
        elif rec.state == "running":
            phase = "Running"
        else:
            phase = "Pending"

        def cond(typ: str, ok: bool, reason: str | None = None) -> dict:
            d = {"type": typ, "status": "True" if ok else "False", "lastProbeTime": None,
                 "lastTransitionTime": t}
            if reason and not ok:
                d["reason"] = reason
            return d
        status = {
            "phase": phase, "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
            "startTime": rec.start_time or t,
            "conditions": [cond("PodReadyToStartContainers", rec.sandbox is not None
                                or rec.spec.get("hostNetwork", False) or phase in TERMINAL),
                           cond("Initialized", rec.initialized, "ContainersNotInitialized"),
                           cond("Ready", ready, "PodCompleted" if phase in TERMINAL
                                else "ContainersNotReady"),
                           cond("ContainersReady", ready, "PodCompleted" if phase in TERMINAL
                                else "ContainersNotReady"),
                           cond("PodScheduled", True)],
            "containerStatuses": statuses,
        }
        if rec.init_containers:
            status["initContainerStatuses"] = [self._container_status(rec, c)
                                               for c in rec.init_containers.values()]
        if rec.ip:
            status["podIP"] = rec.ip
            status["podIPs"] = [{"ip": rec.ip}]
        if rec.pod_failure and phase in TERMINAL:
            status["reason"], status["message"] = rec.pod_failure
        return status

    def report(self, rec: PodRecord) -> None:
        with rec.status_lock:
            with rec.lock:
                if rec.state == "gone":
                    return
                status = self.compute_status(rec)
            # Skip identical writes (ignoring timestamps that change every call).
            key = json.dumps({k: v for k, v in status.items() if k != "conditions"},
                             sort_keys=True) + str([c["status"] for c in status["conditions"]])
            if key == rec.last_status:
                return
            try:
                self.client.merge_patch(f"/api/v1/namespaces/{rec.ns}/pods/{rec.name}/status",
                                        {"status": status})
                rec.last_status = key
                return
            except ApiError as e:
                if e.status == 404:
                    return
                log.warning("status of %s/%s not written: %s", rec.ns, rec.name, e)
            except Exception as e:
                log.warning("status of %s/%s not written: %s", rec.ns, rec.name, e)
        # The API server may be restarting: retry (recomputing the then current status).
        self.timers.later(3, lambda: self.submit(lambda: self.report(rec)))

    # ---------------------------------------------------------------- /etc/hosts
    def peers(self, ns: str) -> list[tuple[str, str, str]]:
        with self.lock:
            recs = [r for r in self.records.values() if r.ns == ns]
        return [(r.ip, *r.dns_name) for r in recs
                if r.dns_name and r.ip and r.state in ("starting", "running", "new")
                and not r.spec.get("hostNetwork")]

    def write_hosts(self, rec: PodRecord, peers: list | None = None) -> None:
        if rec.spec.get("hostNetwork"):
            return
        content = hosts_file(rec.pod, rec.ip, self.peers(rec.ns) if peers is None else peers)
        path = os.path.join(rec.dir, "hosts")
        # In place (no rename): the file is bind-mounted, a new inode would not be seen.
        with open(path, "a+") as f:
            f.seek(0)
            if f.read() == content:
                return
            f.seek(0)
            f.truncate()
            f.write(content)

    def mark_hosts_dirty(self, ns: str) -> None:
        with self.hosts_cv:
            self.hosts_dirty.add(ns)
            self.hosts_cv.notify()

    def hosts_loop(self) -> None:
        while True:
            with self.hosts_cv:
                while not self.hosts_dirty:
                    self.hosts_cv.wait()
            time.sleep(0.1)  # batch the updates of many pods starting together
            with self.hosts_cv:
                dirty, self.hosts_dirty = self.hosts_dirty, set()
            for ns in dirty:
                peers = self.peers(ns)
                with self.lock:
                    recs = [r for r in self.records.values()
                            if r.ns == ns and r.state in ("starting", "running")]
                for r in recs:
                    try:
                        self.write_hosts(r, peers)
                    except OSError as e:
                        log.warning("hosts file of %s/%s: %s", r.ns, r.name, e)

    # ---------------------------------------------------------------- volumes
    def claims_loop(self) -> None:
        """Provision a hostPath PersistentVolume for every unbound claim (no storage class or
        class `local-path`), standing in for a local-path provisioner; the real PV controller
        in kube-controller-manager then binds them."""
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                lst = self.client.get("/api/v1/persistentvolumeclaims")
                for pvc in lst["items"]:
                    self.provision(pvc)
                backoff = 1.0
                for ev in self.client.watch("/api/v1/persistentvolumeclaims",
                                            lst["metadata"]["resourceVersion"]):
                    if ev["type"] == "ERROR":
                        raise ApiError(ev["object"].get("code", 500), "watch error")
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self.provision(ev["object"])
            except Exception as e:
                log.info("claim watch interrupted (%s); relisting in %.0fs", e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5)

    def provision(self, pvc: dict) -> None:
        meta, spec = pvc["metadata"], pvc["spec"]
        if spec.get("volumeName") or meta.get("deletionTimestamp") or \
                spec.get("storageClassName") not in (None, "", "local-path"):
            return
        name = f"local-{meta['uid']}"
        path = os.path.join(self.args.state_dir, "volumes", f"{meta['namespace']}_{meta['name']}_"
                                                             f"{meta['uid']}")
        os.makedirs(path, exist_ok=True)
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": name, "labels": {"local-node-agent/provisioned": "true"}},
              "spec": {"capacity": {"storage": (spec.get("resources") or {}).get(
                           "requests", {}).get("storage", "1Gi")},
                       "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                       "persistentVolumeReclaimPolicy": "Retain",
                       "storageClassName": spec.get("storageClassName") or "",
                       "volumeMode": spec.get("volumeMode") or "Filesystem",
                       "hostPath": {"path": path, "type": "DirectoryOrCreate"},
                       "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                    "namespace": meta["namespace"], "name": meta["name"],
                                    "uid": meta["uid"]}}}
        try:
            self.client.post("/api/v1/persistentvolumes", pv)
            log.info("provisioned %s at %s for claim %s/%s", name, path, meta["namespace"],
                     meta["name"])
        except ApiError as e:
            if e.status != 409:
                log.warning("provisioning a volume for %s/%s failed: %s", meta["namespace"],
                            meta["name"], e)

    # ---------------------------------------------------------------- logs
    def find_log(self, ns: str, pod: str, container: str, previous: bool
                 ) -> tuple[str | None, Callable[[], bool]]:
        with self.lock:
            rec = next((r for r in self.records.values() if r.ns == ns and r.name == pod), None)
        name = f"{container}.previous.log" if previous else f"{container}.log"
        if rec is not None:
            c = rec.containers.get(container) or rec.init_containers.get(container)

            def running() -> bool:
                return c is not None and (c.proc is not None or c.restart_pending) \
                    and rec.state != "gone"
            return os.path.join(rec.dir, name), running
        import glob
        found = sorted(glob.glob(os.path.join(self.pods_dir, f"{ns}_{pod}_*", name)),
                       key=os.path.getmtime)
        return (found[-1] if found else None), lambda: False

    # ---------------------------------------------------------------- main
    def shutdown(self) -> None:
        """Stop every pod process now; the pods stay in the API and are adopted on restart."""
        self.stopping.set()
        with self.lock:
            recs = list(self.records.values())
        for rec in recs:
            with rec.lock:
                for c in rec.live():
                    kill_group(c.proc.pid, signal.SIGKILL)
                if rec.init_proc is not None:
                    kill_group(rec.init_proc.pid, signal.SIGKILL)
                if rec.sandbox is not None:
                    kill_group(rec.sandbox.pid, signal.SIGKILL)
        log.info("stopped the processes of %d pods", len(recs))

    def run(self) -> None:
        self.register_nodes()
        for i, _ in enumerate(self.node_names):
            serve_kubelet_api(self.node_port(i), self.args.tls_cert, self.args.tls_key,
                              self.find_log)
        threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self.hosts_loop, name="hosts", daemon=True).start()
        threading.Thread(target=self.claims_loop, name="claims", daemon=True).start()
        for name in self.node_names:
            self.renew_lease(name)
        self.watch_loop()


class _PodDone(Exception):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cache = os.environ.get("ACCELERATE_OPERATOR_CACHE",
                           os.path.expanduser("~/.cache/accelerate-operator"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", default=os.path.join(cache, "cluster", "kubeconfig"))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--node-prefix", default="local-node-")
    p.add_argument("--port-base", type=int, default=10250)
    p.add_argument("--state-dir", default=os.path.join(cache, "cluster"))
    p.add_argument("--bridge", default="ao-br0")
    p.add_argument("--bridge-cidr", default="10.244.0.1/16")
    p.add_argument("--tls-cert", default=os.path.join(cache, "cluster", "pki", "kubelet.crt"))
    p.add_argument("--tls-key", default=os.path.join(cache, "cluster", "pki", "kubelet.key"))
    p.add_argument("--venv-bin", help="directory put first on pods' PATH (default: ours)")
    p.add_argument("--cpu", default="16")
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--max-pods", type=int, default=1100)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--lease-interval", type=float, default=10)
    return p.parse_args(argv)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    agent = Agent(parse_args())

    def on_signal(signum: int, frame: object) -> None:
        agent.shutdown()
        os._exit(0)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run()


if __name__ == "__main__":
    main()
