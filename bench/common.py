"""Shared pieces of the benchmarks: the cluster client, namespaces, raw watches, log following,
the operator process's /proc readings, and the median. What one benchmark measures is in its own
file (a burst's figures, shared by two, in burst.py).

Benchmark scripts only: nothing in operator/ or trainer/ imports this. Timestamps are taken on
this machine (time.monotonic) when an event or a log line arrives, so every duration includes
the watch or log delivery delay (milliseconds for watches; see LogFollower for logs)."""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# devtools (the same cluster helpers the tests use), and this checkout's packages rather than
# whichever checkout last installed itself into the shared venv.
sys.path[:0] = [str(p) for p in (ROOT, ROOT / "operator", ROOT / "trainer")
                if str(p) not in sys.path]

import kubernetes  # noqa: E402
from accelerate_operator.constants import GROUP, PLURAL, VERSION  # noqa: E402
from accelerate_trainer.contract import JOB_NAME_LABEL  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402
from kubernetes.watch.watch import iter_resp_lines  # noqa: E402

from devtools.cluster import ensure_cluster, kubectl_binary  # noqa: E402

OPERATOR_NAMESPACE = os.environ.get("ACCELERATE_OPERATOR_NAMESPACE", "accelerate-system")
OPERATOR_SERVICE_ACCOUNT = os.environ.get("ACCELERATE_OPERATOR_SERVICE_ACCOUNT",
                                          "accelerate-operator")
CACHE = Path(os.environ.get("ACCELERATE_OPERATOR_CACHE",
                            Path.home() / ".cache" / "accelerate-operator"))
# The local cluster's nodes (hack/lib/nodes.sh): a node's /var/log is the host folder
# <NODES_DIR>/<node>/log, so its kubelet's pod logs (/var/log/pods) are readable from here.
NODES_DIR = CACHE / "cluster" / "nodes"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_LABEL = "accelerate-operator.io/benchmark"


# ------------------------------------------------------------------ cluster
class Cluster:
    """API clients for one kubeconfig, with a connection pool big enough for bursts."""

    def __init__(self, kubeconfig: str | None = None, pool_size: int = 64):
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or ensure_cluster()
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=self.kubeconfig,
                                           client_configuration=configuration)
        configuration.connection_pool_maxsize = pool_size
        self.api = kubernetes.client.ApiClient(configuration)
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.flowcontrol = kubernetes.client.FlowcontrolApiserverV1Api(self.api)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 300,
                input_text: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([kubectl_binary(), "--kubeconfig", self.kubeconfig, *args],
                              capture_output=True, text=True, timeout=timeout, input=input_text)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    # -------------------------------------------------------------- namespaces
    def create_namespace(self, prefix: str) -> str:
        """A fresh namespace, returned once its default ServiceAccount exists (pods need it)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace({"metadata": {"name": name, "labels": {BENCH_LABEL: "true"}}})
        wait_until(lambda: self._has_default_sa(name), 60, f"ServiceAccount default in {name}")
        return name

    def _has_default_sa(self, namespace: str) -> bool:
        try:
            self.core.read_namespaced_service_account("default", namespace)
            return True
        except ApiException as error:
            if error.status == 404:
                return False
            raise

    def delete_namespace(self, name: str, wait: bool = True, timeout: float = 600) -> float:
        """Delete a namespace; with wait, block until it is gone and return how long that took."""
        started = time.monotonic()
        try:
            self.core.delete_namespace(name)
        except ApiException as error:
            if error.status != 404:
                raise
        if wait:
            wait_until(lambda: not self._namespace_exists(name), timeout,
                       f"namespace {name} to be deleted", interval=1.0)
        return time.monotonic() - started

    def _namespace_exists(self, name: str) -> bool:
        try:
            self.core.read_namespace(name)
            return True
        except ApiException as error:
            if error.status == 404:
                return False
            raise

    def create_job(self, body: dict) -> None:
        """POST an AccelerateJob without deserialising the answer (cheap in bursts)."""
        self.create_custom(body, GROUP, VERSION, PLURAL)

    def create_custom(self, body: dict, group: str, version: str, plural: str) -> None:
        """POST a namespaced custom object without deserialising the answer."""
        response = self.custom.create_namespaced_custom_object(
            group, version, body["metadata"]["namespace"], plural, body, _preload_content=False)
        response.read()  # drain the body before the connection goes back to the pool
        response.release_conn()

    def job(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def _ready(cluster: Cluster, operator: bool = True) -> bool:
    try:
        response = cluster.api.call_api("GET", cluster.api.configuration.host + "/readyz",
                                        _request_timeout=5)
        if response.read() != b"ok":
            return False
        if not operator:
            return True
        pods = cluster.core.list_namespaced_pod(
            OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=accelerate-operator")
        return any(p.status.phase == "Running" and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods.items) and OperatorProcess.find(cluster) is not None
    except Exception:  # noqa: BLE001 (down, or coming up)
        return False


def wait_for_cluster(cluster: Cluster, timeout: float = 600, operator: bool = True) -> None:
    """The shared local cluster is restarted now and then: wait until the API server is ready
    and (with operator) the operator runs again."""
    wait_until(lambda: _ready(cluster, operator), timeout,
               "the API server and the operator" if operator else "the API server", interval=2)


def delete_leftovers(cluster: Cluster) -> None:
    """Namespaces of earlier benchmark runs that an outage kept from being cleaned up."""
    try:
        for ns in cluster.core.list_namespace(label_selector=BENCH_LABEL).items:
            if not ns.metadata.deletion_timestamp:
                cluster.core.delete_namespace(ns.metadata.name)
    except Exception as error:  # noqa: BLE001 (best effort)
        print(f"  (could not delete leftover benchmark namespaces: {error})")


def resilient(cluster: Cluster, what: str, fn: Callable[[], Any], attempts: int = 3,
              operator: bool = True) -> Any:
    """Run one unit of measurement; when it fails (typically because the shared cluster was
    restarted under it), wait for the cluster and (with operator) the operator, then run it
    again from scratch."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001
            if attempt == attempts:
                raise
            print(f"  ! {what} failed ({type(error).__name__}: {str(error)[:200]}); waiting for "
                  f"the cluster and retrying ({attempt}/{attempts - 1})", flush=True)
            wait_for_cluster(cluster, operator=operator)
            delete_leftovers(cluster)
    raise AssertionError("not reached")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------ watches
class Watcher(threading.Thread):
    """One raw watch (JSON lines, no model deserialisation) on one kind in one namespace.
    Calls on_event(arrival_monotonic, type, object) from its own thread."""

    KINDS = {
        "pods": ("core", "list_namespaced_pod"),
        "configmaps": ("core", "list_namespaced_config_map"),
        "services": ("core", "list_namespaced_service"),
        "acceleratejobs": ("custom", None),
        "pytorchjobs": ("custom", None),
    }
    CUSTOM = {  # kind: (group, version, plural)
        "acceleratejobs": (GROUP, VERSION, PLURAL),
        "pytorchjobs": ("kubeflow.org", "v1", "pytorchjobs"),  # bench/kubeflow_compare.py
    }

    def __init__(self, cluster: Cluster, kind: str, namespace: str,
                 on_event: Callable[[float, str, dict], None], label_selector: str | None = None):
        super().__init__(daemon=True, name=f"watch-{kind}")
        self.cluster, self.kind, self.namespace = cluster, kind, namespace
        self.on_event, self.label_selector = on_event, label_selector
        self._stop_event = threading.Event()
        self._response = None
        self.error: BaseException | None = None
        # Set when the watch broke (an API server restart): timings taken across it are void.
        self.disturbed = False

    def _list(self, **kwargs: Any):
        extra = {"label_selector": self.label_selector} if self.label_selector else {}
        if self.kind in self.CUSTOM:
            group, version, plural = self.CUSTOM[self.kind]
            return self.cluster.custom.list_namespaced_custom_object(
                group, version, self.namespace, plural, **extra, **kwargs)
        api, method = self.KINDS[self.kind]
        return getattr(getattr(self.cluster, api), method)(self.namespace, **extra, **kwargs)

    def _relist(self) -> None:
        listing = self._list(_preload_content=False)
        data = json.loads(listing.data)
        now = time.monotonic()
        for item in data.get("items") or []:
            self.on_event(now, "ADDED", item)
        self._resource_version = data["metadata"]["resourceVersion"]

    def start(self) -> Watcher:
        # List first (synchronously) so no event after start() returns is missed.
        self._relist()
        super().start()
        return self

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._response = self._list(watch=True, resource_version=self._resource_version,
                                            timeout_seconds=600, _preload_content=False,
                                            allow_watch_bookmarks=True)
                for line in iter_resp_lines(self._response):
                    if self._stop_event.is_set():
                        return
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":  # 410 Gone after an API server restart
                        self.disturbed = True
                        self._relist()
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if rv:
                        self._resource_version = rv
                    if event["type"] != "BOOKMARK":
                        self.on_event(time.monotonic(), event["type"], obj)
            except Exception as error:  # closed by stop(), or a broken connection
                if self._stop_event.is_set():
                    return
                self.disturbed, self.error = True, error
                time.sleep(0.5)
                try:
                    self._relist()
                except Exception:  # noqa: BLE001 (still down: the next round tries again)
                    pass

    def stop(self) -> None:
        self._stop_event.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown() if hasattr(response, "shutdown") else response.close()
            except Exception:  # noqa: BLE001 (best effort: the thread is a daemon)
                pass


def start_watchers(cluster: Cluster, namespace: str, on_event: Callable[[float, str, dict], None],
                   kinds: Iterable[str] = ("acceleratejobs", "configmaps", "services", "pods"),
                   selectors: Mapping[str, str] | None = None) -> list[Watcher]:
    """One watch per kind, each with its label selector from `selectors` (by kind) if any."""
    return [Watcher(cluster, kind, namespace,
                    lambda t, typ, obj, kind=kind: on_event(t, kind, typ, obj),
                    label_selector=(selectors or {}).get(kind)).start()
            for kind in kinds]


def stop_watchers(watchers: Iterable[Watcher]) -> None:
    """Stop the watches; raise when one of them broke meanwhile (the cluster was restarted
    under the measurement), so resilient() runs the measurement again."""
    watchers = list(watchers)
    for watcher in watchers:
        watcher.stop()
    broken = [w.kind for w in watchers if w.disturbed]
    if broken:
        raise ClusterDisturbed(f"the watch on {', '.join(broken)} broke during the measurement "
                               "(API server restarted?)")


class ClusterDisturbed(RuntimeError):
    """The cluster went away during a measurement; its numbers are void."""


# ------------------------------------------------------------------ logs
def kubelet_log_files(namespace: str, pod: str, container: str) -> list[str]:
    """The container's CRI log files on any local node: <node>/log/pods/<ns>_<pod>_<uid>/
    <container>/<restart count>.log (the kubelet's /var/log/pods, bind-mounted from the host)."""
    return glob.glob(str(NODES_DIR / "*" / "log" / "pods" / f"{namespace}_{pod}_*" / container /
                         "*.log"))


def parse_cri_line(raw: bytes) -> tuple[str, bool]:
    """One line of a CRI log file, `<RFC3339Nano time> <stdout|stderr> <F|P> <text>`: the text,
    and whether the line is complete (F) or a partial chunk (P) continued on the next line."""
    parts = raw.split(b" ", 3)
    if len(parts) < 3 or parts[1] not in (b"stdout", b"stderr"):
        return raw.decode(errors="replace"), True  # not CRI: the raw line
    text = parts[3] if len(parts) == 4 else b""
    return text.decode(errors="replace"), parts[2] != b"P"


class LogFollower(threading.Thread):
    """Follows one container's log and calls on_line(arrival_monotonic, line) for every line.

    On the local cluster it reads the kubelet's log file of the container directly, from the
    node's /var/log/pods bind mount on this host (polled every 20 ms, CRI format parsed), since
    `kubectl logs -f` goes API server -> kubelet -> file and adds its own delay. Anywhere else,
    or when the container has started but no file shows up (a remote cluster with the same
    namespaces), it follows the log through the API."""

    FILE_GRACE_S = 5.0  # container started, no file this long: not on a local node

    def __init__(self, cluster: Cluster, namespace: str, pod: str, container: str,
                 on_line: Callable[[float, str], None], poll: float = 0.02):
        super().__init__(daemon=True, name=f"log-{pod}")
        self.cluster, self.namespace, self.pod, self.container = cluster, namespace, pod, container
        self.on_line, self.poll = on_line, poll
        self._stop_event = threading.Event()
        self.source = "none"  # "file" or "api", once known

    def stop(self) -> None:
        self._stop_event.set()

    def _local_file(self) -> str | None:
        found = kubelet_log_files(self.namespace, self.pod, self.container)
        return max(found, key=os.path.getmtime) if found else None

    def _container_started(self) -> bool:
        try:
            pod = self.cluster.core.read_namespaced_pod(self.pod, self.namespace)
        except ApiException:
            return False
        for status in (pod.status.container_statuses or []) if pod.status else []:
            if status.name == self.container and status.state and (
                    status.state.running or status.state.terminated):
                return True
        return False

    def run(self) -> None:
        if NODES_DIR.is_dir():
            path = self._wait_for_file()
            if path is not None:
                self.source = "file"
                self._follow_file(path)
                return
        if not self._stop_event.is_set():
            self.source = "api"
            self._follow_api()

    def _wait_for_file(self) -> str | None:
        """The log file once it exists; None when stopped, or when the container has run
        FILE_GRACE_S without one (then the API is the way)."""
        next_check = time.monotonic() + 1.0
        started_at: float | None = None
        while not self._stop_event.is_set():
            path = self._local_file()
            if path is not None:
                return path
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 1.0
                if started_at is None and self._container_started():
                    started_at = now
                if started_at is not None and now - started_at > self.FILE_GRACE_S:
                    return None
            time.sleep(self.poll)
        return None

    def _follow_file(self, path: str) -> None:
        pending = b""
        partial = ""
        with open(path, "rb") as f:
            while not self._stop_event.is_set():
                chunk = f.read()
                if not chunk:
                    time.sleep(self.poll)
                    continue
                now = time.monotonic()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    text, complete = parse_cri_line(raw)
                    if not complete:
                        partial += text
                        continue
                    self.on_line(now, partial + text)
                    partial = ""

    def _follow_api(self) -> None:
        while not self._stop_event.is_set():
            try:
                response = self.cluster.core.read_namespaced_pod_log(
                    self.pod, self.namespace, container=self.container, follow=True,
                    _preload_content=False)
                for line in iter_resp_lines(response):
                    self.on_line(time.monotonic(), line)
                    if self._stop_event.is_set():
                        return
                return
            except ApiException:  # not started yet
                time.sleep(0.2)


# ------------------------------------------------------------------ the operator process
class OperatorProcess:
    """The operator's process, from /proc: RSS, peak RSS and CPU time. The operator runs in a
    container on a local node, and a container's processes are ordinary processes of this host
    (in other namespaces), so /proc/<pid> of this host has them."""

    def __init__(self, pid: int):
        self.pid = pid

    @staticmethod
    def _operator_pod_uids(cluster: Cluster | None) -> list[str]:
        if cluster is None:
            return []
        try:
            pods = cluster.core.list_namespaced_pod(
                OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=accelerate-operator")
        except Exception:  # noqa: BLE001 (no API: fall back to the newest process)
            return []
        running = {p.metadata.name: p.metadata.uid for p in pods.items
                   if p.status and p.status.phase == "Running"
                   and not p.metadata.deletion_timestamp}
        active = OperatorProcess._active_replica(cluster, running)
        return [running[active]] if active else list(running.values())

    @staticmethod
    def _active_replica(cluster: Cluster, running: dict[str, str]) -> str | None:
        """With several replicas, the one kopf's peering keeps active: the live record of
        highest priority in the ClusterKopfPeering (the others are paused standbys, which a
        benchmark must not measure). None without peering."""
        try:
            peering = kubernetes.client.CustomObjectsApi(cluster.api).get_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings", "accelerate-operator")
        except Exception:  # noqa: BLE001 (no peering: one replica)
            return None
        records = [(info.get("priority", 0), identity.split("@", 1)[-1].split("/", 1)[0])
                   for identity, info in (peering.get("status") or {}).items()]
        live = sorted((priority, pod) for priority, pod in records if pod in running)
        return live[-1][1] if live else None

    @classmethod
    def find(cls, cluster: Cluster | None = None) -> OperatorProcess | None:
        """The newest process whose command is `accelerate-operator` (its console script; in the
        image: `/opt/venv/bin/python /opt/venv/bin/accelerate-operator ...`). With a cluster,
        processes in the cgroup of a running operator pod (`.../pod<uid>/<container>`, as the
        kubelet names them) come first, so an operator someone runs by hand is not taken for
        the deployed one."""
        found = []
        for stat in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                argv = Path(stat).read_bytes().split(b"\0")
            except OSError:
                continue
            if any(os.path.basename(a) == b"accelerate-operator" for a in argv[:2]) or (
                b"accelerate_operator" in argv[:3]
            ):
                pid = int(stat.split("/")[2])
                try:
                    found.append((cls(pid).start_ticks(), pid))
                except OSError:  # gone meanwhile
                    continue
        if not found:
            return None
        uids = cls._operator_pod_uids(cluster)
        if uids:
            in_pod = [(ticks, pid) for ticks, pid in found if cls._in_pod(pid, uids)]
            if in_pod:
                found = in_pod
        return cls(max(found)[1])

    @staticmethod
    def _in_pod(pid: int, uids: list[str]) -> bool:
        try:
            cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        return any(f"pod{uid}" in cgroups or f"pod{uid.replace('-', '_')}" in cgroups
                   for uid in uids)

    def _status(self) -> dict[str, str]:
        fields = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        return fields

    def rss_mib(self) -> float:
        return int(self._status()["VmRSS"].split()[0]) / 1024

    def peak_rss_mib(self) -> float:
        return int(self._status()["VmHWM"].split()[0]) / 1024

    def reset_peak(self) -> bool:
        """Reset VmHWM to the current RSS (`echo 5 > clear_refs`, needs root); False if denied."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def _stat(self) -> list[str]:
        return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()

    def cpu_seconds(self) -> float:
        fields = self._stat()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    def start_ticks(self) -> int:
        return int(self._stat()[19])

    def age_seconds(self) -> float:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - self.start_ticks() / CLK_TCK

    def threads(self) -> int:
        return int(self._status()["Threads"])


class RssSampler(threading.Thread):
    """Samples the operator's RSS every `interval` seconds; `peak` is the highest sample."""

    def __init__(self, process: OperatorProcess, interval: float = 0.25):
        super().__init__(daemon=True, name="rss-sampler")
        self.process, self.interval = process, interval
        self.peak = 0.0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.peak = max(self.peak, self.process.rss_mib())
            except (OSError, KeyError):
                return
            time.sleep(self.interval)

    def stop(self) -> float:
        self._stop_event.set()
        return self.peak


def read_metrics(cluster: Cluster) -> str:
    configuration = cluster.api.configuration
    headers = {setting["key"]: setting["value"]
               for setting in configuration.auth_settings().values()
               if setting.get("in") == "header" and setting.get("value")}
    response = cluster.api.call_api("GET", configuration.host + "/metrics", header_params=headers)
    return response.read().decode()


# ------------------------------------------------------------------ numbers
def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (cores: {os.cpu_count()})"


def machine_line() -> str:
    return f"load average {load_average()}"


def job_of(obj: dict) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL)


def emit_result(name: str, result: dict, path: str | None) -> None:
    """Append the result as one JSON line (for run.sh's summary) when a path is given."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"benchmark": name, **result}) + "\n")


def host_processes(names: Iterable[str], marker: bytes | None = None) -> dict[str, list[int]]:
    """The pids of this host's processes by the basename of their argv[0], for each of `names`
    (the local cluster runs its control plane and kubelets as host processes); with `marker`,
    only those whose command line holds it."""
    found: dict[str, list[int]] = {name: [] for name in names}
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmdline = Path(path).read_bytes()
            argv0 = os.path.basename(cmdline.split(b"\0")[0]).decode()
        except (OSError, UnicodeDecodeError):
            continue
        if argv0 in found and (marker is None or marker in cmdline):
            found[argv0].append(int(path.split("/")[2]))
    return found
