"""What one progress write of a running job costs the API server, how much of it is the CRD's
validation rules (x-kubernetes-validations, CEL), and what the atomic status saves.

A status write is a running job's main control-plane cost (docs/performance.md, "Running
jobs"). The API server validates the whole object on every write to the status subresource,
the spec's CEL rules included: apiextensions' status strategy runs every rule of the schema
against the new and old object, however little of the status changed; and it records in
managedFields what each manager owns. This benchmark measures that apart from everything else
on a cluster: its own etcd and kube-apiserver (the binaries of hack/build-control-plane.sh,
nothing else running on them), three copies of our CRD, each under its own group (as shipped;
the same schema without its rules; the same with a granular status, Kubernetes' default, each
leaf of it a field of managedFields), one `examples/cpu-ddp.yaml` job in each with the status
of a running job, and in the shipped CRD a second such job whose status is only its phase (what
the size of a running job's status costs each write); the operator's progress write
(progress.build_progress_status and the goodput totals) is sent to each in turn, sequentially.
It reads the API server's CPU time from /proc around each block (common.OperatorProcess, as
bench/running.py reads the control plane's) and prints the CPU per write for each, the rules'
share, the atomic status's saving and the status size's cost. `--profile FILE` then saves a
CPU profile of the API server (Go's pprof, `go tool pprof -top FILE`) over 20 s of writes to
the shipped CRD: where the rest of a write goes.

Usage: python bench/status_write.py [--writes 600] [--rounds 3] [--json FILE] [--profile FILE]
"""

from __future__ import annotations

import argparse
import copy
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from common import OperatorProcess, emit_result, machine_line, median
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from kubernetes import client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
from accelerate_operator.progress import build_progress_status  # noqa: E402

CRD = ROOT / "crds" / "accelerate-operator.io_acceleratejobs.yaml"
JOB = ROOT / "examples" / "cpu-ddp.yaml"
TOKEN = "status-write-bench"
NAMESPACE = "bench"
GROUPS = {"rules": "accelerate-operator.io", "no_rules": "norules.bench.accelerate-operator.io",
          "granular": "granular.bench.accelerate-operator.io"}
# Each measured block: (its CRD's group, the job written). "phase_only" is the shipped CRD's
# second job, whose status is only its phase: the same writes, a smaller object.
JOB_NAME, PHASE_ONLY_NAME = "cpu-ddp", "cpu-ddp-phase-only"
BLOCKS = {**{name: (group, JOB_NAME) for name, group in GROUPS.items()},
          "phase_only": (GROUPS["rules"], PHASE_ONLY_NAME)}
PROFILE_SECONDS = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_key(path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))


@contextmanager
def api_server(work: Path) -> Iterator[tuple[client.ApiClient, int]]:
    """etcd and kube-apiserver of our pinned version on free ports; the client and the API
    server's pid."""
    bin_dir = Path(subprocess.run([str(ROOT / "hack" / "build-control-plane.sh")], check=True,
                                  stdout=subprocess.PIPE, text=True).stdout.split()[-1])
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    write_key(work / "sa.key")
    (work / "tokens.csv").write_text(f"{TOKEN},bench,1,system:masters\n")
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    etcd = subprocess.Popen([bin_dir / "etcd", "--data-dir", work / "etcd",
                             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = open(work / "apiserver.log", "w")  # its tail goes into the error if it never serves
    server = subprocess.Popen([
        bin_dir / "kube-apiserver", "--etcd-servers", etcd_url, "--bind-address", "127.0.0.1",
        "--secure-port", str(api_port), "--cert-dir", work / "certs",
        "--token-auth-file", work / "tokens.csv", "--authorization-mode", "AlwaysAllow",
        "--service-account-issuer", "https://kubernetes.default.svc",
        "--service-account-key-file", work / "sa.key",
        "--service-account-signing-key-file", work / "sa.key",
        "--service-cluster-ip-range", "10.96.0.0/16"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        config = client.Configuration()
        config.host, config.verify_ssl = f"https://127.0.0.1:{api_port}", False
        config.api_key = {"authorization": f"Bearer {TOKEN}"}
        api = client.ApiClient(config)
        wait_ready(api, server, work / "apiserver.log")
        yield api, server.pid
    finally:
        for process in (server, etcd):
            process.terminate()
            process.wait(30)
        log.close()


def wait_ready(api: client.ApiClient, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            client.CoreV1Api(api).list_namespace(_request_timeout=5)
            return
        except Exception:  # noqa: BLE001 (not up yet: connection refused, 503, ...)
            time.sleep(1)
    tail = "\n".join(log.read_text().splitlines()[-20:])
    raise RuntimeError(f"kube-apiserver did not serve in 120 s (exit {server.poll()}):\n{tail}")


def without_rules(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: without_rules(value) for key, value in node.items()
                if key != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [without_rules(value) for value in node]
    return node


def granular_status(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD with its status map granular (Kubernetes' default), not atomic."""
    crd = copy.deepcopy(crd)
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"].pop(
        "x-kubernetes-map-type")
    return crd


def install(api: client.ApiClient) -> None:
    """The three CRDs, the namespace, and each block's job with its status."""
    shipped = yaml.safe_load(CRD.read_text())
    extensions, custom = client.ApiextensionsV1Api(api), client.CustomObjectsApi(api)
    for name, crd in (("rules", shipped), ("no_rules", without_rules(shipped)),
                      ("granular", granular_status(shipped))):
        crd["spec"]["group"] = GROUPS[name]
        crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{GROUPS[name]}"
        extensions.create_custom_resource_definition(crd)
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
    job = yaml.safe_load(JOB.read_text())
    for group, name in BLOCKS.values():
        body = {**copy.deepcopy(job), "apiVersion": f"{group}/v1alpha1"}
        body["metadata"] = {**body["metadata"], "name": name}
        for _ in range(60):  # until the new CRD is served
            try:
                custom.create_namespaced_custom_object(group, "v1alpha1", NAMESPACE,
                                                       "acceleratejobs", body)
                break
            except client.ApiException:
                time.sleep(1)
        status = {"phase": "Running"} if name == PHASE_ONLY_NAME else running_status()
        patch_status(api, group, name, status)


def running_status() -> dict[str, Any]:
    """What the operator has written by the time a 2-node job trains (a live job's, read back)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    versions = {"accelerate": "1.15.0", "accelerate-operator": "0.1.0", "datasets": "5.2.0",
                "deepspeed": "0.19.8", "python": "3.11.2", "torch": "2.15.0",
                "transformers": "5.24.0"}
    lost = {"idle": 0, "recomputed": 0, "recovery": 0, "startup": 13, "waiting": 1}
    return {"phase": "Running", "reason": "Running", "observedGeneration": 1, "startTime": now,
            "attempt": 0, "attemptStartTime": now, "restarts": 0, "restartsCounted": 0,
            "readyNodes": "2/2", "nodes": {"active": 2, "ready": 2, "succeeded": 0, "failed": 0},
            "topology": {"numNodes": 2, "numProcPerNode": 2, "worldSize": 4,
                         "masterPort": 29500, "summary": "2x2"},
            "trainer": {"attempt": 0, "image": "trainer:0.1.0-cpu", "versions": versions},
            "goodput": {"percent": 50.0, "summary": "50.0%", "wallSeconds": 30,
                        "productiveSeconds": 15, "lostSeconds": lost, "interruptions": 0,
                        "ledger": {"segment": "Running", "since": now, "highestStep": 1,
                                   "lastStep": 1, "lastStepTime": now, "lost": lost,
                                   "reducedOpen": False}},
            "conditions": [{"type": kind, "status": "True", "reason": reason, "message": message,
                            "lastTransitionTime": now, "observedGeneration": 1}
                           for kind, reason, message in (
                               ("Created", "PodsCreated",
                                "ConfigMap, headless Service and 2 pod(s) created"),
                               ("Running", "AllNodesRunning", "all 2 node(s) are running"))]}


def progress_write(step: int) -> dict[str, Any]:
    """What the operator sends when only pod 0's progress moved (decide.build_status_write)."""
    report = {"step": step, "total_steps": 100_000, "loss": 1 + 1 / step, "epoch": 0.5,
              "samples_per_second": 64.0, "eta_seconds": 100_000 - step}
    goodput = {"percent": 97.5, "summary": "97.5%", "wallSeconds": step + 30.0,
               "productiveSeconds": step + 29.0, "lostSeconds": {"startup": 1.0},
               "interruptions": 0}
    return {"progress": build_progress_status(report, datetime.now(timezone.utc)),
            "goodput": goodput}


def patch_status(api: client.ApiClient, group: str, name: str, status: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        group, "v1alpha1", NAMESPACE, "acceleratejobs", name, {"status": status})


def measure(api: client.ApiClient, pid: int, writes: int, rounds: int) -> dict[str, list]:
    """API server CPU ms per write, per round, the blocks in turn (a warm-up first)."""
    server = OperatorProcess(pid)
    per_write: dict[str, list] = {name: [] for name in BLOCKS}
    step = 1
    for round_ in range(rounds + 1):
        for name, (group, job) in BLOCKS.items():
            count = writes if round_ else writes // 10
            before = server.cpu_seconds()
            for _ in range(count):
                step += 1
                patch_status(api, group, job, progress_write(step))
            if round_:
                per_write[name].append(1000 * (server.cpu_seconds() - before) / count)
    return per_write


def profile(api: client.ApiClient, path: Path) -> int:
    """The API server's CPU profile over PROFILE_SECONDS of progress writes to the shipped
    CRD's running job, saved to `path` (pprof's format); returns the writes it covers."""
    writes, done = [0], threading.Event()

    def write() -> None:
        while not done.is_set():
            writes[0] += 1
            patch_status(api, GROUPS["rules"], JOB_NAME, progress_write(writes[0] + 1))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        request = api.param_serialize("GET", "/debug/pprof/profile",
                                      query_params=[("seconds", PROFILE_SECONDS)],
                                      header_params={"Accept": "*/*"},
                                      auth_settings=["BearerToken"])
        response = api.call_api(*request, _request_timeout=PROFILE_SECONDS + 60)
        response.read()
        if response.status != 200:
            raise RuntimeError(f"the API server's profile: HTTP {response.status}")
        path.write_bytes(response.data)
    finally:
        done.set()
        writer.join()
    return writes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=600, help="writes per block per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    parser.add_argument("--profile", type=Path,
                        help="then save the API server's CPU profile (pprof) of 20 s of writes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="status-write-") as work, \
            api_server(Path(work)) as (api, pid):
        install(api)
        per_write = measure(api, pid, args.writes, args.rounds)
        profiled = profile(api, args.profile) if args.profile else 0
    print_result(per_write, args.rounds, args.writes, args.json)
    if args.profile:
        print(f"  CPU profile of {profiled} writes to the shipped CRD: {args.profile} "
              f"(go tool pprof -top {args.profile})")


def print_result(per_write: dict[str, list], rounds: int, writes: int, json_file: str | None
                 ) -> None:
    rules, bare = median(per_write["rules"]), median(per_write["no_rules"])
    granular, small = median(per_write["granular"]), median(per_write["phase_only"])
    print(machine_line())
    print(f"API server CPU per progress write, median of {rounds} rounds of {writes}:")
    print(f"  CRD as shipped:            {rules:6.2f} ms  {per_write['rules']}")
    print(f"  same CRD without rules:    {bare:6.2f} ms  {per_write['no_rules']}")
    print(f"  same with granular status: {granular:6.2f} ms  {per_write['granular']}")
    print(f"  shipped, status only phase:{small:6.2f} ms  {per_write['phase_only']}")
    print(f"  the rules' share:          {rules - bare:6.2f} ms = "
          f"{100 * (rules - bare) / rules:.0f}%")
    print(f"  atomic status saves:       {granular - rules:6.2f} ms = "
          f"{100 * (granular - rules) / granular:.0f}% of the granular write")
    print(f"  a running job's status:    {rules - small:6.2f} ms = "
          f"{100 * (rules - small) / rules:.0f}% (its size: every write decodes, validates, "
          "stores and sends the whole object)")
    emit_result("status_write", {"rules_ms": rules, "no_rules_ms": bare, "granular_ms": granular,
                                 "phase_only_ms": small, "rules_share": (rules - bare) / rules,
                                 "atomic_saving": (granular - rules) / granular,
                                 "status_share": (rules - small) / rules,
                                 "rounds": per_write}, json_file)


if __name__ == "__main__":
    main()
