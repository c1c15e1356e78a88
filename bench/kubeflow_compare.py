"""The same burst as throughput.py, run against Kubeflow's Go training-operator (PyTorchJob).

For comparing our operator with the Go one on the same cluster, in one session: run
bench/throughput.py (our operator, deployed in the cluster) and this script (the Go operator,
a process on this host), and compare the lines they print.

What it sets up (and removes at the end):
  - the PyTorchJob CRD of the training-operator's version (server-side apply; left in place
    with --keep-crd, and never deleted when it was there before)
  - namespace training-operator-bench with the ServiceAccount `training-operator`, the empty
    Secret its certificate rotator fills, a ClusterRole(Binding) granting what the module's
    manifests/base/rbac/role.yaml grants, and a kubeconfig with a token of that ServiceAccount,
    so that its requests are counted exactly, like our operator's (FlowSchemas matching only
    that ServiceAccount, see common.install_flow_schemas)
  - the operator binary (hack/build-training-operator.sh; built once, cached) as a process of
    this host: --enable-scheme=pytorchjob, no gang scheduler, no leader election, metrics, health
    probe and webhook ports picked free. Its validating webhook is served but not registered
    with the API server (it could not reach a host process under the Service name the
    webhook's certificate is for); our operator has no admission webhook either. The certificate
    rotator writes its certificate into the Secret; since no kubelet mounts that Secret here,
    this script writes the files to /tmp/k8s-webhook-server/serving-certs (the path the
    operator hard-codes), as the mount would.

Each profile starts the operator afresh, waits until the PyTorchJob controller's workers run
(its log says "Starting workers"), reads the idle RSS, then creates N PyTorchJobs at once into a
fresh namespace: 1 Master + 1 Worker, each pod with a nodeSelector no node matches (so pods stay
Pending: throughput.py's pending mode) and the same tiny container. A job counts as reconciled
once both pods and both Services exist and its status is right: a Created=True condition, and
replicaStatuses for Master and Worker whose `active` counts equal the pods of that type that
are Running (0 here). That is throughput.py's "children exist and the status agrees with them".

Reported per profile: time until every job is reconciled, jobs/s, per-job latency p50/p99, the
operator's CPU ms per job and API requests per job (both after --settle seconds more), idle
RSS, peak RSS (VmHWM, reset before the burst, and 4 samples/s), RSS once the namespace has been
deleted (deletion complete, then throughput.py's rule: polled until within 10 MiB of idle, for
at most 20 s).

Profiles (--profile):
  defaults   the binary's defaults: --kube-api-qps 20 --kube-api-burst 30 --controller-threads 1
  tuned      --kube-api-qps 1000 --kube-api-burst 2000 --controller-threads 32
             (--qps/--burst/--threads change these)
  both       defaults, then tuned (the default)

Usage: python bench/kubeflow_compare.py [--jobs 500] [--profile both] [--keep-crd]
       [--binary PATH]   (skip hack/build-training-operator.sh)
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from burst import (
    BurstTracker,
    CountedClient,
    add_burst_arguments,
    control_plane_cpu,
    control_plane_processes,
    delete_flow_schemas,
    diff_counts,
    install_flow_schemas,
    operator_request_counts,
    print_control_plane,
    timed_burst,
)
from common import (
    ROOT,
    Cluster,
    OperatorProcess,
    RssSampler,
    delete_leftovers,
    emit_result,
    machine_line,
    resilient,
    start_watchers,
    stop_watchers,
    wait_for_cluster,
    wait_until,
)
from kubernetes.client.rest import ApiException
from throughput import NO_SUCH_NODE, RUNNING_IMAGE, settled_rss

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
CRD_NAME = f"{PLURAL}.{GROUP}"
NAMESPACE = "training-operator-bench"
SERVICE_ACCOUNT = "training-operator"  # the manifests' name
CLUSTER_ROLE = "bench-training-operator"  # not the manifests' name: a real install keeps its own
CERT_SECRET = "training-operator-webhook-cert"  # the binary's --webhook-secret-name default
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # hard-coded in its pkg/cert
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_TYPES = ("Master", "Worker")

TRAINING_OPERATOR = CountedClient(
    SERVICE_ACCOUNT, NAMESPACE, "bench-training-operator", [
        ("create-pods", ["create"], [""], ["pods"]),
        ("create-services", ["create"], [""], ["services"]),
        ("create-events", ["create"], ["", "events.k8s.io"], ["events"]),
        ("patch-events", ["patch", "update"], ["", "events.k8s.io"], ["events"]),
        ("update-pods", ["patch", "update"], [""], ["pods", "services"]),
        ("update-job-status", ["patch", "update"], [GROUP], [f"{PLURAL}/status"]),
        ("update-job", ["patch", "update"], [GROUP], [PLURAL]),
        ("get", ["get"], ["*"], ["*"]),
        ("list-watch", ["list", "watch"], ["*"], ["*"]),
        ("delete", ["delete", "deletecollection"], ["*"], ["*"]),
        ("other", ["*"], ["*"], ["*"]),
    ], first_precedence=1100)


def job_body(namespace: str, name: str) -> dict:
    def replica() -> dict:
        return {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {
            "containers": [{
                "name": "pytorch",  # the operator's default container name
                "image": RUNNING_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "3600"],
                "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}},
            }],
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": dict(NO_SUCH_NODE),
        }}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": {rtype: replica() for rtype in REPLICA_TYPES}},
    }


# ------------------------------------------------------------------ the binary and its setup
def build(version: str) -> tuple[Path, Path]:
    """hack/build-training-operator.sh: (manifests folder, binary); instant once built."""
    started = time.monotonic()
    proc = subprocess.run([str(ROOT / "hack" / "build-training-operator.sh")],
                          env={**os.environ, "TRAINING_OPERATOR_VERSION": version},
                          stdout=subprocess.PIPE, text=True, check=True)
    *_, manifests, binary = proc.stdout.strip().splitlines()
    took = time.monotonic() - started
    if took > 5:
        print(f"  (built the training-operator {version} in {took:.0f}s)", flush=True)
    return Path(manifests), Path(binary)


class Setup:
    """What the Go operator needs in the cluster; remove() takes back what install() added."""

    def __init__(self, cluster: Cluster, manifests: Path, keep_crd: bool):
        self.cluster, self.manifests, self.keep_crd = cluster, manifests, keep_crd
        self.crd_existed = False
        self.kubeconfig: str | None = None

    def _apply(self, docs: list[dict]) -> None:
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts",
                             "--field-manager=bench-kubeflow-compare", "-f", "-",
                             input_text=yaml.safe_dump_all(docs))

    def install(self) -> None:
        self.crd_existed = self.cluster.kubectl(
            "get", "crd", CRD_NAME, "--ignore-not-found", "-o", "name").stdout.strip() != ""
        crd = yaml.safe_load((self.manifests / "crds" / f"{GROUP}_{PLURAL}.yaml").read_text())
        self._apply([crd])
        # (not `kubectl wait`: it fails while the new CRD has no conditions yet)
        wait_until(lambda: self.cluster.kubectl(
            "get", "crd", CRD_NAME, "-o",
            'jsonpath={.status.conditions[?(@.type=="Established")].status}',
            check=False).stdout == "True",
            60, f"CRD {CRD_NAME} to be established", interval=0.5)
        role = yaml.safe_load((self.manifests / "rbac" / "role.yaml").read_text())
        role["metadata"] = {"name": CLUSTER_ROLE}
        self._apply([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE}},
            role,
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": CLUSTER_ROLE},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": CLUSTER_ROLE},
             "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT,
                           "namespace": NAMESPACE}]},
        ])
        install_flow_schemas(self.cluster, client=TRAINING_OPERATOR)
        self.kubeconfig = self._write_kubeconfig()

    def fresh_secret(self) -> None:
        """An empty certificate Secret, as the manifests ship it: the rotator only updates it."""
        try:
            self.cluster.core.delete_namespaced_secret(CERT_SECRET, NAMESPACE)
        except ApiException as error:
            if error.status != 404:
                raise
        wait_until(lambda: not self._secret(), 30, f"Secret {CERT_SECRET} to go")
        self.cluster.core.create_namespaced_secret(NAMESPACE, {
            "metadata": {"name": CERT_SECRET}, "type": "Opaque"})

    def _secret(self) -> dict | None:
        try:
            return self.cluster.core.read_namespaced_secret(CERT_SECRET, NAMESPACE).data or {}
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def mount_certs(self, stop: threading.Event) -> None:
        """Do the kubelet's part: once the rotator has filled the Secret, write its tls.crt and
        tls.key where the operator looks for them."""
        while not stop.is_set():
            data = self._secret() or {}
            if data.get("tls.crt") and data.get("tls.key"):
                CERT_DIR.mkdir(parents=True, exist_ok=True)
                for key in ("tls.crt", "tls.key"):
                    path = CERT_DIR / key
                    path.write_bytes(base64.b64decode(data[key]))
                    path.chmod(0o600)
                return
            stop.wait(0.25)

    def _write_kubeconfig(self) -> str:
        token = self.cluster.core.create_namespaced_service_account_token(
            SERVICE_ACCOUNT, NAMESPACE, {"spec": {"expirationSeconds": 6 * 3600}}).status.token
        admin = yaml.safe_load(Path(self.cluster.kubeconfig).read_text())
        context = next(c for c in admin["contexts"]
                       if c["name"] == admin["current-context"])["context"]
        server = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "bench", "cluster": server["cluster"]}],
            "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
            "contexts": [{"name": "bench", "context": {"cluster": "bench",
                                                        "user": SERVICE_ACCOUNT}}],
        }
        fd, path = tempfile.mkstemp(prefix="training-operator-", suffix=".kubeconfig")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def remove(self) -> None:
        if self.kubeconfig:
            Path(self.kubeconfig).unlink(missing_ok=True)
        for key in ("tls.crt", "tls.key"):
            (CERT_DIR / key).unlink(missing_ok=True)
        steps = [
            lambda: delete_flow_schemas(self.cluster, TRAINING_OPERATOR),
            lambda: self.cluster.kubectl("delete", "clusterrolebinding,clusterrole", CLUSTER_ROLE,
                                         "--ignore-not-found"),
            lambda: self.cluster.delete_namespace(NAMESPACE, wait=True),
        ]
        if not (self.keep_crd or self.crd_existed):
            steps.append(lambda: self.cluster.kubectl("delete", "crd", CRD_NAME,
                                                      "--ignore-not-found"))
        for step in steps:
            try:
                step()
            except Exception as error:  # noqa: BLE001 (clean up the rest anyway)
                print(f"  (cleanup step failed: {error})", flush=True)


# ------------------------------------------------------------------ the operator process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GoOperator:
    """The training-operator binary as a child process, logging to a file."""

    def __init__(self, binary: Path, setup: Setup, qps: int | None, burst: int | None,
                 threads: int | None, log_path: Path):
        self.setup, self.log_path = setup, log_path
        self.probe_port = free_port()
        args = [str(binary), "--enable-scheme=pytorchjob",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{self.probe_port}",
                f"--webhook-server-port={free_port()}"]
        for flag, value in (("--kube-api-qps", qps), ("--kube-api-burst", burst),
                            ("--controller-threads", threads)):
            if value is not None:
                args.append(f"{flag}={value}")
        self.args = args
        self.tuning = " ".join(a for a in args if a.startswith(("--kube-api", "--controller")))
        self.proc: subprocess.Popen | None = None
        self._stop_certs = threading.Event()

    def start(self, timeout: float = 120) -> OperatorProcess:
        self.setup.fresh_secret()
        for key in ("tls.crt", "tls.key"):  # an earlier run's: the rotator must not see them
            (CERT_DIR / key).unlink(missing_ok=True)
        env = {**os.environ, "KUBECONFIG": self.setup.kubeconfig, "MY_POD_NAMESPACE": NAMESPACE}
        env.pop("KUBEFLOW_NAMESPACE", None)  # watch every namespace, as the default install
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(self.args, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self.setup.mount_certs, args=(self._stop_certs,),
                         daemon=True, name="mount-certs").start()
        wait_until(self._ready, timeout, f"the training-operator (log: {self.log_path})",
                   interval=0.25)
        return OperatorProcess(self.proc.pid)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the training-operator exited ({self.proc.returncode}):\n"
                               + self.log_tail())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz",
                                        timeout=2) as response:
                if response.status != 200:
                    return False
        except OSError:
            return False
        # readyz passes once the webhook server listens; the controller's informers may still
        # be syncing: its workers start after that.
        return any(b"Starting workers" in line and b"pytorchjob" in line
                   for line in self.log_path.read_bytes().splitlines())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self._stop_certs.set()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()


# ------------------------------------------------------------------ the burst
class Tracker(BurstTracker):
    """Per-job state fed by the watches; records when each job first becomes reconciled."""

    def __init__(self, names: list[str]):
        super().__init__(names)
        # job -> pod -> (replica-type label, phase)
        self.pods: dict[str, dict[str, tuple[str, str]]] = {n: {} for n in names}
        self.services: dict[str, set[str]] = {n: set() for n in names}
        self.status: dict[str, dict] = {}

    def on_event(self, t: float, kind: str, typ: str, obj: dict) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        labels = meta.get("labels") or {}
        with self.lock:
            if kind == "pytorchjobs":
                job = name
                if typ == "DELETED" or job not in self.names:
                    return
                self.status[job] = obj.get("status") or {}
            else:
                job = labels.get(JOB_NAME_LABEL)
                if job not in self.names:
                    return
                if typ == "DELETED":
                    self.services[job].discard(name)
                    self.pods[job].pop(name, None)
                    return
                if kind == "services":
                    self.services[job].add(name)
                else:
                    self.pod_seen.setdefault(name, t)
                    self.pods[job][name] = (labels.get(REPLICA_TYPE_LABEL, ""),
                                            (obj.get("status") or {}).get("phase", ""))
            self._check(t, job)

    def _check(self, t: float, job: str) -> None:
        if job in self.reconciled_at:
            return
        status = self.status.get(job)
        pods = list(self.pods[job].values())
        if status is None or len(pods) < len(REPLICA_TYPES) \
                or len(self.services[job]) < len(REPLICA_TYPES):
            return
        created = any(c.get("type") == "Created" and c.get("status") == "True"
                      for c in status.get("conditions") or [])
        replicas = status.get("replicaStatuses") or {}
        consistent = created and all(
            rtype in replicas and int(replicas[rtype].get("active") or 0) == sum(
                1 for kind, phase in pods if kind == rtype.lower() and phase == "Running")
            for rtype in REPLICA_TYPES)
        if consistent:
            self.mark_reconciled(t, job)

    def describe(self, job: str) -> str:
        status = self.status.get(job, {})
        return (f"pods={self.pods[job]} services={sorted(self.services[job])} "
                f"conditions={[c.get('type') for c in status.get('conditions') or []]} "
                f"replicaStatuses={status.get('replicaStatuses')}")


def burst(cluster: Cluster, args: argparse.Namespace, operator: OperatorProcess,
          idle_mib: float) -> dict:
    jobs = args.jobs
    namespace = cluster.create_namespace("bench-kubeflow")
    names = [f"job-{i:04d}" for i in range(jobs)]
    tracker = Tracker(names)
    watchers = start_watchers(cluster, namespace, tracker.on_event,
                              kinds=("pytorchjobs", "services", "pods"))
    result: dict = {"jobs": jobs, "namespace": namespace, "operator_pid": operator.pid}
    operator.reset_peak()
    result["operator_rss_before_mib"] = operator.rss_mib()
    cpu_before = operator.cpu_seconds()
    sampler = RssSampler(operator)
    sampler.start()
    requests_before = operator_request_counts(cluster, TRAINING_OPERATOR)
    control_plane = control_plane_processes()
    control_plane_before = {name: proc.cpu_seconds() for name, proc in control_plane.items()}
    bodies = [job_body(namespace, name) for name in names]
    try:
        _, timings = timed_burst(
            tracker, lambda body: cluster.create_custom(body, GROUP, VERSION, PLURAL), bodies,
            args.clients, args.timeout, len(REPLICA_TYPES))
        result.update(timings)
        result.update({
            "operator_cpu_s": operator.cpu_seconds() - cpu_before,
            "requests_at_reconciled": diff_counts(
                operator_request_counts(cluster, TRAINING_OPERATOR), requests_before),
        })
        time.sleep(args.settle)  # late writes still belong to these jobs
        requests = diff_counts(operator_request_counts(cluster, TRAINING_OPERATOR),
                               requests_before)
        result["requests_settled"] = requests
        result["requests_per_job"] = sum(requests.values()) / jobs
        result.update(control_plane_cpu(control_plane_before, control_plane, jobs))
        result["operator_cpu_settled_s"] = operator.cpu_seconds() - cpu_before
        result["operator_cpu_ms_per_job"] = result["operator_cpu_settled_s"] * 1000 / jobs
        result["operator_peak_rss_mib"] = max(sampler.stop(), operator.peak_rss_mib())
        result["operator_rss_with_jobs_mib"] = operator.rss_mib()
    finally:
        sampler.stop()
        stop_watchers(watchers)
        t_delete = time.monotonic()
        cluster.delete_namespace(namespace, wait=True)
        result["cleanup_s"] = time.monotonic() - t_delete
        result["operator_rss_after_cleanup_mib"] = settled_rss(operator, idle_mib)
        result["operator_cpu_total_s"] = operator.cpu_seconds() - cpu_before
    return result


def run_profile(cluster: Cluster, args: argparse.Namespace, binary: Path, setup: Setup,
                profile: str) -> dict:
    flags = {"qps": None, "burst": None, "threads": None} if profile == "defaults" else \
        {"qps": args.qps, "burst": args.burst, "threads": args.threads}
    log_path = Path(args.log_dir) / f"training-operator-{profile}.log"
    go = GoOperator(binary, setup, log_path=log_path, **flags)
    install_flow_schemas(cluster, client=TRAINING_OPERATOR)  # again: a restart may lose them
    t_start = time.monotonic()
    try:
        operator = go.start()
        result: dict = {"profile": profile, "flags": go.args[1:], "tuning": go.tuning,
                        "startup_s": time.monotonic() - t_start, "log": str(log_path)}
        time.sleep(args.idle)  # let start-up garbage settle before the idle reading
        result["idle_rss_mib"] = operator.rss_mib()
        result["threads_idle"] = operator.threads()
        result.update(burst(cluster, args, operator, result["idle_rss_mib"]))
    except BaseException:
        print(go.log_tail(), file=sys.stderr)
        raise
    finally:
        go.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_burst_arguments(parser, timeout=600)
    parser.add_argument("--profile", choices=("defaults", "tuned", "both"), default="both")
    parser.add_argument("--qps", type=int, default=1000, help="tuned: --kube-api-qps")
    parser.add_argument("--burst", type=int, default=2000, help="tuned: --kube-api-burst")
    parser.add_argument("--threads", type=int, default=32, help="tuned: --controller-threads")
    parser.add_argument("--version", default=os.environ.get("TRAINING_OPERATOR_VERSION",
                                                            "v1.9.4"))
    parser.add_argument("--binary", help="a training-operator binary (default: build it)")
    parser.add_argument("--idle", type=float, default=5.0,
                        help="seconds between the operator's start and the idle RSS reading")
    parser.add_argument("--keep-crd", action="store_true", help="leave the PyTorchJob CRD")
    parser.add_argument("--log-dir", default=tempfile.gettempdir(),
                        help="the operator's logs go here")
    args = parser.parse_args(argv)

    manifests, default_binary = build(args.version)
    binary = Path(args.binary) if args.binary else default_binary
    cluster = Cluster()
    wait_for_cluster(cluster, operator=False)  # ours need not run: this measures the Go one
    delete_leftovers(cluster)
    print(f"kubeflow: {args.jobs} PyTorchJobs (Master + Worker, pods Pending) at once against "
          f"training-operator {args.version} ({binary}); {args.clients} client threads; "
          f"{machine_line()}", flush=True)
    setup = Setup(cluster, manifests, args.keep_crd)
    profiles = ("defaults", "tuned") if args.profile == "both" else (args.profile,)
    results: dict = {"version": args.version, "binary": str(binary)}
    try:
        setup.install()
        for profile in profiles:
            r = resilient(cluster, f"{profile} burst",
                          lambda profile=profile: run_profile(cluster, args, binary, setup,
                                                              profile),
                          operator=False)
            results[profile] = r
            print(f"  [{profile}] operator flags: {r['tuning'] or '(its defaults)'}; up in "
                  f"{r['startup_s']:.1f}s, {r['threads_idle']} threads", flush=True)
            print(f"  [{profile}] all {r['jobs']} jobs reconciled in {r['reconciled_s']:.2f}s: "
                  f"{r['jobs_per_s']:.1f} jobs/s, {r['pods_per_s']:.1f} pods/s; submit took "
                  f"{r['submit_s']:.2f}s; per-job latency p50 {r['job_latency_p50_s']:.2f}s "
                  f"p99 {r['job_latency_p99_s']:.2f}s", flush=True)
            print(f"  [{profile}] operator API requests: {r['requests_per_job']:.2f} per job "
                  f"(after {args.settle:.0f}s settle): {r['requests_settled']}")
            print(f"  [{profile}] operator CPU {r['operator_cpu_settled_s']:.1f}s "
                  f"({r['operator_cpu_ms_per_job']:.1f} ms/job), idle RSS "
                  f"{r['idle_rss_mib']:.1f} MiB, peak RSS {r['operator_peak_rss_mib']:.1f} MiB, "
                  f"RSS after cleanup {r['operator_rss_after_cleanup_mib']:.1f} MiB; cleanup "
                  f"{r['cleanup_s']:.1f}s", flush=True)
            print_control_plane(profile, r)
    finally:
        setup.remove()
    print(f"  {machine_line()}")
    emit_result("kubeflow", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
