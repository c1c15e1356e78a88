"""docs/getting-started.md, run as written: the commands of its blocks marked `<!-- test: run -->`
are typed into a shell, in order, against the cluster, and each must succeed; a block marked
`<!-- test: output -->` shows what the command before it prints, and its table header and row
names must be what the command really printed. So the page cannot drift from what works.
Before the page's clean-up deletes it, the example job it trained is checked as a user would
check that it was really distributed: four ranks over two nodes, one model, a falling loss.

The commands run as a reader runs them: from the repository's root, `kubectl` and
`accelerate-job` on PATH (this checkout's CLI), a kubeconfig whose current context points at a
fresh namespace (what `kubectl config set-context --current --namespace` does), nothing else."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.cluster import ROOT, kubectl, kubectl_binary

PAGE = ROOT / "docs" / "getting-started.md"
BLOCK = re.compile(r"<!-- test: (run|output) -->\s*\n```[a-z]*\n(.*?)\n```", re.S)

pytestmark = [pytest.mark.timeout(1200)]


@dataclass(frozen=True)
class Block:
    kind: str  # "run": commands, one a line; "output": what the last command printed
    text: str


def read_blocks(page: Path = PAGE) -> list[Block]:
    return [Block(kind, text) for kind, text in BLOCK.findall(page.read_text())]


def commands(block: Block) -> list[str]:
    return [line for line in block.text.splitlines() if line.strip()
            and not line.lstrip().startswith("#")]


def table(text: str) -> tuple[list[str], list[str]]:
    """The header's columns and each row's first column, of a table as kubectl prints it."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0].split(), [line.split()[0] for line in lines[1:]]


def shell_env(tmp_path: Path, kubeconfig: str, namespace: str) -> dict[str, str]:
    """PATH with kubectl and this checkout's accelerate-job; a kubeconfig copy whose current
    context is in `namespace`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(kubectl_binary())
    cli = bin_dir / "accelerate-job"
    cli.write_text(f"#!/bin/sh\nexec {sys.executable} -m accelerate_job \"$@\"\n")
    cli.chmod(0o755)
    config = tmp_path / "kubeconfig"
    shutil.copy(kubeconfig, config)
    env = {**os.environ, "KUBECONFIG": str(config),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer")])}
    subprocess.run(["kubectl", "config", "set-context", "--current", f"--namespace={namespace}"],
                   env=env, check=True, capture_output=True)
    return env


def test_the_page_marks_the_commands_of_a_first_job():
    blocks = read_blocks()
    runs = [command for block in blocks if block.kind == "run" for command in commands(block)]
    assert runs[0] == "kubectl apply -f examples/cpu-ddp.yaml"
    assert any(command.startswith("accelerate-job wait") for command in runs)
    assert any(block.kind == "output" for block in blocks)


def assert_trained_four_ranks(kubeconfig: str, namespace: str) -> None:
    """The example job ended Succeeded with no restart, and its pods' logs prove it was really
    distributed: ranks 0-3 of world size 4 over two nodes, identical weights, the loss down."""
    status = json.loads(kubectl("-n", namespace, "get", "acceleratejob", "cpu-ddp", "-o",
                                "json", kubeconfig=kubeconfig).stdout).get("status", {})
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["restarts"] == 0
    assert status["nodes"]["succeeded"] == 2

    logs = {i: kubectl("-n", namespace, "logs", f"cpu-ddp-{i}", kubeconfig=kubeconfig).stdout
            for i in range(2)}
    ranks = {}
    for node, text in logs.items():
        for rank, local, world, node_rank in re.findall(
                r"RANK_INFO rank=(\d+) local_rank=(\d+) world_size=(\d+) node_rank=(\d+)", text):
            assert world == "4" and int(node_rank) == node
            # Static rendezvous gives node k the global ranks 2k and 2k+1.
            assert int(rank) == 2 * node + int(local), (rank, local, node)
            ranks[int(rank)] = node
    assert sorted(ranks) == [0, 1, 2, 3], f"ranks seen: {ranks}"
    assert sorted(set(ranks.values())) == [0, 1]
    # Only global rank 0 logs steps and the summary.
    assert "STEP step=" not in logs[1] and "TRAINING_DONE" not in logs[1], logs[1][-2000:]

    finals = [(int(rank), int(steps), checksum) for text in logs.values()
              for rank, checksum, steps in re.findall(
                  r"FINAL rank=(\d+) param_checksum=(\S+) steps=(\d+)", text)]
    assert sorted(rank for rank, _, _ in finals) == [0, 1, 2, 3], finals
    assert {steps for _, steps, _ in finals} == {40}, finals
    checksums = {checksum for _, _, checksum in finals}
    assert len(checksums) == 1, f"weights differ across ranks: {checksums}"
    done = re.search(r"TRAINING_DONE steps=(\d+) first_loss=(\S+) last_loss=(\S+)", logs[0])
    assert done, logs[0][-2000:]
    steps, first, last = int(done.group(1)), float(done.group(2)), float(done.group(3))
    assert steps == 40
    assert last < first * 0.7, f"loss did not go down enough: {first} -> {last}"

    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.kind=AccelerateJob", "-o", "json", kubeconfig=kubeconfig)
    reasons = [e["reason"] for e in json.loads(events.stdout)["items"]]
    assert {"PodsCreated", "AllNodesRunning", "AllNodesSucceeded"} <= set(reasons)


def test_getting_started_commands_work_as_written(kubeconfig: str, namespace: str,
                                                   tmp_path: Path):
    env = shell_env(tmp_path, kubeconfig, namespace)
    last, checked = "", False
    for block in read_blocks():
        if block.kind == "output":
            assert table(last) == table(block.text), (
                f"docs/getting-started.md shows:\n{block.text}\nbut the command printed:\n{last}")
            continue
        if commands(block)[0].startswith("kubectl delete ajob cpu-ddp"):
            assert_trained_four_ranks(kubeconfig, namespace)
            checked = True
        for command in commands(block):
            proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, text=True,
                                  capture_output=True, timeout=900)
            assert proc.returncode == 0, (
                f"`{command}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                f"{proc.stderr[-3000:]}")
            last = proc.stdout
    assert checked, "the page no longer deletes the job it trained: check it before that"
