"""End to end: a training script that exists only on the laptop, with a working directory (a helper
module beside it, a package, files its .gitignore excludes) and a requirements file, submitted
through the `accelerate-job` CLI, trained on two nodes to Succeeded.

Checks that the code travelled whole and only what it should (the ConfigMap `<job>-code`, owned
by the job, holds the tarball whose sha256 the job names, without the ignored files), that every
pod ran the shipped script from /workspace and imported its helpers, that the requirements were
installed before launch with pip's output in the log (a requirement the image already satisfies:
our cluster reaches no package index), that status.trainer shows the versions the trainer ran
with, and that deleting the job takes the code with it."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
from accelerate_job import AccelerateJobClient

from devtools.cluster import kubectl, kubectl_json, wait_for
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.cli import cli

pytestmark = [pytest.mark.timeout(600)]

NAME = "laptop"
NODES = 2
STEPS = 12
CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
use_cpu: true
mixed_precision: "no"
"""
TRAIN_PY = '''\
"""A script that lives only on the laptop: not in the trainer image."""
import argparse

import torch
from accelerate import Accelerator
from accelerate_trainer import progress

import helpers
from lib.data import batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = last = None
    for step, (x, y) in enumerate(batches(args.steps, accelerator.process_index), start=1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        first = loss.item() if first is None else first
        last = loss.item()
        progress.report(step=step, total_steps=args.steps, loss=last)
    print(helpers.marker(accelerator.process_index, accelerator.num_processes, first, last),
          flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
'''
HELPERS_PY = '''\
def marker(rank, world, first, last):
    return f"SHIPPED_CODE_OK rank={rank} world={world} first_loss={first:.4f} last_loss={last:.4f}"
'''
DATA_PY = '''\
import torch


def batches(steps, rank):
    generator = torch.Generator().manual_seed(1234 + rank)
    weight = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        yield x, x @ weight
'''


def make_project(root: Path) -> Path:
    """The laptop's working directory."""
    (root / "lib").mkdir(parents=True)
    (root / "train.py").write_text(TRAIN_PY)
    (root / "helpers.py").write_text(HELPERS_PY)
    (root / "lib" / "__init__.py").write_text("")
    (root / "lib" / "data.py").write_text(DATA_PY)
    (root / "requirements.txt").write_text("accelerate>=1.0\n")
    (root / ".gitignore").write_text("data/\n*.secret\n")
    (root / "data").mkdir()
    (root / "data" / "huge.bin").write_bytes(b"\0" * (4 * 1024 * 1024))  # past any ConfigMap
    (root / "token.secret").write_text("never shipped\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"\0")
    return root


def shipped_files(configmap: dict) -> tuple[str, list[str]]:
    data = base64.b64decode(configmap["binaryData"]["code.tar.gz"])
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return hashlib.sha256(data).hexdigest(), sorted(tar.getnames())


def test_a_local_script_with_its_workdir_trains_to_succeeded(kubeconfig, namespace, tmp_path):
    project = make_project(tmp_path / "project")
    config = tmp_path / "accelerate.yaml"
    config.write_text(CPU_CONFIG)
    assert not Path("/opt/accelerate/examples/helpers.py").exists()  # nothing comes from here

    submitted = cli("submit", "--config", str(config), "--image", TRAINER_CPU_IMAGE,
                    "--nodes", str(NODES), "--procs-per-node", "1", "--name", NAME,
                    "--env", "OMP_NUM_THREADS=1", "--workdir", ".",
                    "--requirements", "requirements.txt",
                    "train.py", "--steps", str(STEPS),
                    kubeconfig=kubeconfig, namespace=namespace, cwd=project)
    assert "shipped 6 file(s)" in submitted.stderr, submitted.stderr

    client = AccelerateJobClient(kubeconfig=kubeconfig, namespace=namespace)
    job = client.get(NAME)
    assert job["spec"]["code"]["configMap"] == f"{NAME}-code"
    assert job["spec"]["code"]["requirements"] == "requirements.txt"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "train.py", "--steps", str(STEPS)]

    # The code travelled whole, owned by the job, without what .gitignore and the defaults drop.
    code_cm = kubectl_json("-n", namespace, "get", "configmap", f"{NAME}-code",
                           kubeconfig=kubeconfig)
    digest, names = shipped_files(code_cm)
    assert digest == job["spec"]["code"]["sha256"]
    assert names == [".gitignore", "helpers.py", "lib/__init__.py", "lib/data.py",
                     "requirements.txt", "train.py"]
    assert [(o["kind"], o["name"], o["uid"]) for o in code_cm["metadata"]["ownerReferences"]] \
        == [("AccelerateJob", NAME, job["metadata"]["uid"])]
    assert code_cm.get("immutable") is True

    waited = cli("wait", NAME, "--timeout", "480s", kubeconfig=kubeconfig, namespace=namespace,
                 timeout=510, check=False)
    logs = cli("logs", NAME, "--all", kubeconfig=kubeconfig, namespace=namespace,
               check=False).stdout
    assert waited.returncode == 0, f"{waited.stderr}\n{logs[-4000:]}"

    # Every pod unpacked the code, installed the requirements, and ran the shipped script.
    for node in range(NODES):
        assert re.search(rf"\[node {node}\] accelerate-trainer: unpacked the shipped code into "
                         r"/workspace: 6 file\(s\)", logs), logs[-4000:]
        assert re.search(rf"\[node {node}\] Requirement already satisfied: accelerate", logs)
        assert re.search(rf"\[node {node}\] accelerate-trainer: versions \(image\): python ",
                         logs)
    ranks = dict(re.findall(r"SHIPPED_CODE_OK rank=(\d+) world=(\d+)", logs))
    assert ranks == {"0": str(NODES), "1": str(NODES)}, logs[-4000:]
    first, last = map(float, re.search(
        r"SHIPPED_CODE_OK rank=0 world=\d+ first_loss=(\S+) last_loss=(\S+)", logs).groups())
    assert last < first

    done = client.get(NAME)["status"]
    assert done["phase"] == "Succeeded" and done["restarts"] == 0
    assert done["progress"]["summary"] == f"{STEPS}/{STEPS} (100%)"
    trainer = wait_for(lambda: (client.get(NAME)["status"].get("trainer") or {}).get("versions"),
                       timeout=30, description="status.trainer.versions")
    assert {"python", "accelerate", "torch", "transformers"} <= set(trainer)
    described = kubectl("-n", namespace, "describe", "ajob", NAME, kubeconfig=kubeconfig).stdout
    assert re.search(rf"Accelerate:\s+{re.escape(trainer['accelerate'])}\n", described), described

    # Deleting the job takes its code with it.
    cli("delete", NAME, kubeconfig=kubeconfig, namespace=namespace)
    wait_for(lambda: kubectl("-n", namespace, "get", "configmap", f"{NAME}-code",
                             kubeconfig=kubeconfig, check=False).returncode != 0,
             timeout=60, description="the code ConfigMap to be garbage collected")
    remaining = json.loads(kubectl("-n", namespace, "get", "configmaps", "-o", "json",
                                   kubeconfig=kubeconfig).stdout)["items"]
    assert not [cm for cm in remaining if cm["metadata"]["name"] == f"{NAME}-code"]
