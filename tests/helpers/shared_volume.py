"""A folder every node of the cluster shares (as pods share an NFS volume), for the checkpoints of
multi-node jobs, made and read through the cluster, never through the test runner's disk: on kind
or a real cluster the nodes' disk is not the runner's.

The folders live under SHARED_ROOT on the nodes. The local cluster's nodes share the host's disk;
hack/e2e-kind.sh mounts one host folder at SHARED_ROOT into every kind node. A short root pod
makes each folder writable by the trainer's non-root user (a hostPath the kubelet creates is
root's, 0755), and lists what the jobs wrote."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from devtools.cluster import kubectl, wait_for_phase
from devtools.images import TRAINER_CPU_IMAGE

SHARED_ROOT = "/tmp/accelerate-operator-shared"


def run_in_shared_root(kubeconfig: str, namespace: str, script: str) -> str:
    """Run a shell script as root in a pod that mounts SHARED_ROOT at /shared; its output."""
    name = f"shared-{uuid.uuid4().hex[:6]}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "sh", "image": TRAINER_CPU_IMAGE,
                                    "imagePullPolicy": "IfNotPresent",
                                    "command": ["sh", "-ec", script],
                                    "securityContext": {"runAsUser": 0},
                                    "volumeMounts": [{"name": "shared",
                                                      "mountPath": "/shared"}]}],
                    "volumes": [{"name": "shared", "hostPath": {
                        "path": SHARED_ROOT, "type": "DirectoryOrCreate"}}]}}
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(pod))
    phase = wait_for_phase(kubeconfig, namespace, name, ("Succeeded", "Failed"), timeout=120)
    out = kubectl("-n", namespace, "logs", name, kubeconfig=kubeconfig).stdout
    kubectl("-n", namespace, "delete", "pod", name, "--wait=false", kubeconfig=kubeconfig)
    assert phase == "Succeeded", f"`{script}` failed in pod {name}:\n{out}"
    return out


@dataclass(frozen=True)
class SharedDir:
    """One test's folder: `path` on every node (a hostPath), and what is in it."""

    name: str

    @property
    def path(self) -> str:
        return f"{SHARED_ROOT}/{self.name}"

    def volume(self, volume: str = "checkpoints") -> dict:
        return {"name": volume, "hostPath": {"path": self.path, "type": "Directory"}}

    def files(self, kubeconfig: str, namespace: str) -> set[str]:
        """Every file under the folder, as paths relative to it."""
        out = run_in_shared_root(kubeconfig, namespace,
                                 f"cd /shared/{self.name} && find . -type f")
        return {line.removeprefix("./") for line in out.splitlines() if line.strip()}


def shared_dir(kubeconfig: str, namespace: str) -> SharedDir:
    """A fresh folder every node mounts, writable by the jobs' non-root trainer."""
    made = SharedDir(f"{namespace}-{uuid.uuid4().hex[:6]}")
    run_in_shared_root(kubeconfig, namespace,
                       f"mkdir -p /shared/{made.name} && chmod 0777 /shared/{made.name}")
    return made
