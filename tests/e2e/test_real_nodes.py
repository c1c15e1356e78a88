"""What only a real node can show: the trainer image under a kubelet, containerd and runc, with
CoreDNS and kube-proxy. A master that comes up late, the restricted security context on a
read-only root, /dev/shm, `kubectl logs/exec/port-forward` into a trainer. (The kernel's OOM
killer turning into a whole-group restart: test_failures_say_why.py.)

Both jobs start when the module starts and train side by side."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from datetime import datetime

import pytest

from devtools.cluster import (
    ROOT,
    create_namespace,
    delete_namespace,
    kubectl,
    kubectl_binary,
    kubectl_json,
    wait_for,
)
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, apply_jobs, phase_is, wait_for_job

# The master's init container holds it this long after the worker's pod has an address, so the
# worker's trainer starts first even when its node is slow to create the pod (seen: 38 s late
# under the side-by-side e2e load, when the hold counted from the master's own start).
HOLD_MASTER_SECONDS = 20


def example_job(name: str, *args: str) -> dict:
    return JobBuilder.from_example(name).args("/opt/accelerate/examples/train.py", *args).build()


def command_job(name: str, script: str, **container: object) -> dict:
    """The example's pod template (image, security context, volumes) running a Python snippet."""
    return JobBuilder.from_example(name).procs(1).command(script).container(**container).build()


def started_at(pod: dict, container: str) -> datetime:
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    state = status["state"].get("running") or status["state"].get("terminated")
    return datetime.strptime(state["startedAt"], "%Y-%m-%dT%H:%M:%SZ")


# The headless Service publishes a pod's name once it has an address (ready or not).
WAIT_FOR_WORKER = ("until getent hosts late-1.late >/dev/null; do sleep 1; done; "
                   f"sleep {HOLD_MASTER_SECONDS}")


def late_master_job() -> dict:
    body = example_job("late", "--max-steps=4", "--log-every=1")
    body["spec"]["template"]["spec"]["initContainers"] = [{
        "name": "hold-master", "image": TRAINER_CPU_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", f'[ "$(hostname)" != late-0 ] || {{ {WAIT_FOR_WORKER}; }}'],
    }]
    return body


SERVE = """
import http.server, os, pathlib
pathlib.Path('/workspace/hello.txt').write_text('hello from ' + os.environ['NODE_RANK'])
os.chdir('/workspace')
print('serving', flush=True)
http.server.HTTPServer(('', 8000), http.server.SimpleHTTPRequestHandler).serve_forever()
"""

PROBE = """
import os, pathlib, shutil
print('uid', os.getuid())
try:
    pathlib.Path('/probe').write_text('x'); print('root writable')
except OSError as e:
    print('root read-only', e.errno)
print('shm_bytes', shutil.disk_usage('/dev/shm').total)
"""


@pytest.fixture(scope="module")
def namespace(kubeconfig: str) -> Iterator[str]:
    """One namespace for the module, both jobs applied at once."""
    name = create_namespace(kubeconfig, prefix="real-nodes")
    apply_jobs(kubeconfig, name, [late_master_job(), command_job("probe", SERVE)])
    yield name
    delete_namespace(kubeconfig, name)


def test_workers_wait_for_a_master_held_back_by_an_init_container_then_rendezvous(
        kubeconfig: str, namespace: str):
    done = wait_for_job(kubeconfig, namespace, "late", phase_is("Succeeded", "Failed"),
                        timeout=420, description="the job with a late master to finish")
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)
    assert done["status"]["restarts"] == 0
    pods = {i: kubectl_json("-n", namespace, "get", "pod", f"late-{i}", kubeconfig=kubeconfig)
            for i in range(2)}
    held = (started_at(pods[0], "trainer") - started_at(pods[1], "trainer")).total_seconds()
    assert held >= 5, f"the worker started only {held}s before the master"
    # The worker started `held` seconds before the master: its store client (the trainer waits
    # only for the name) retried the master's port until it listened, with no restart.
    assert "TRAINING_DONE steps=4" in kubectl("-n", namespace, "logs", "late-0",
                                              kubeconfig=kubeconfig).stdout


def test_running_trainer_is_non_root_on_a_read_only_root_and_reachable_by_logs_exec_port_forward(
        kubeconfig: str, namespace: str):
    wait_for(lambda: "serving" in kubectl("-n", namespace, "logs", "probe-1",
                                          kubeconfig=kubeconfig, check=False).stdout,
             timeout=180, description="the trainer container of probe-1 to serve")

    probed = kubectl("-n", namespace, "exec", "probe-1", "-c", "trainer", "--",
                     "python3", "-c", PROBE, kubeconfig=kubeconfig).stdout
    assert "uid 1000" in probed, probed
    assert "root read-only 30" in probed, probed  # EROFS
    shm = int(re.search(r"shm_bytes (\d+)", probed).group(1))
    assert shm > 64 * 2**20, f"/dev/shm is only {shm} bytes: DataLoader workers need more"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local_port = s.getsockname()[1]
    forward = subprocess.Popen(
        [kubectl_binary(), "--kubeconfig", kubeconfig, "-n", namespace, "port-forward",
         "pod/probe-1", f"{local_port}:8000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        def fetch() -> str:
            with socket.create_connection(("127.0.0.1", local_port), timeout=5) as conn:
                conn.sendall(b"GET /hello.txt HTTP/1.0\r\n\r\n")
                return conn.makefile("rb").read().decode()
        assert "hello from 1" in wait_for(fetch, timeout=30, description="the port-forward")
    finally:
        forward.terminate()
        forward.wait(timeout=10)


@pytest.mark.skipif(os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1",
                    reason="looks into the local cluster's nodes (on kind: docker exec)")
def test_each_node_holds_the_trainer_image_in_its_containerd(kubeconfig: str):
    for node in ("ao-node-0", "ao-node-1"):
        images = subprocess.run(
            [str(ROOT / "hack" / "local-cluster.sh"), "exec", node, "ctr", "-n", "k8s.io",
             "images", "ls", "-q"], capture_output=True, text=True, check=True, timeout=60).stdout
        assert TRAINER_CPU_IMAGE in images.split(), f"{node} lacks {TRAINER_CPU_IMAGE}"
