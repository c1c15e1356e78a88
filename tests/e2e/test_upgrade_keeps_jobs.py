"""End to end: a job started by the previous release's operator keeps training through
`helm upgrade` to this one. The chart and images of the newest release at or before HEAD (its
`v*` tag or, in a clone without tags, its commit in hack/releases.tsv; ACCELERATE_UPGRADE_FROM
names another ref) are installed over the running release, a two-node CPU job trains on its
trainer image, the release is upgraded to this checkout mid-training, and the job ends Succeeded
with 0 restarts: the same pods (uids), no container restarted, no Restarting, Stalled or Failed
condition (the job has a stall timeout shorter than what it trains after the upgrade: the switch
of operators must not look like a stall), and its progress never erased or moved back
(docs/operating.md, Upgrade). With no release to start from the test fails; it never skips."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.cluster import ROOT, kubectl_binary, kubectl_json, wait_for
from devtools.images import OPERATOR_IMAGE, REGISTRY
from tests.helpers.jobs import JobBuilder, apply_job, get_job, phase_is, wait_for_job
from tests.helpers.operator import OPERATOR_NAMESPACE, OPERATOR_SELECTOR, active_operator

# A machine's first run also pushes the base trainer (gigabytes) into hack/load-images.sh's
# layout: minutes of disk. Later runs find it loaded (same image ID) and take about 5 minutes.
pytestmark = [pytest.mark.timeout(1200), pytest.mark.skipif(
    os.environ.get("ACCELERATE_OPERATOR_EXTERNAL_CLUSTER") == "1",
    reason="builds the base version's images and loads them into the local cluster's nodes")]

BASE_TAG = "upgrade-base"
BASE_OPERATOR = f"{REGISTRY}/operator:{BASE_TAG}"
BASE_TRAINER = f"{REGISTRY}/trainer:{BASE_TAG}-cpu"
NAME = "upgraded"
# About 80 s of training, mostly sleep: it spans the upgrade on a two-core machine (which took
# 14 s here), and goes on for longer than STALL_TIMEOUT (the CRD's least) once the new operator
# is active (the test fails, saying so, where the upgrade takes more than about 45 s).
MAX_STEPS, SLEEP_PER_STEP, STALL_TIMEOUT = 55, 1.5, 30


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


RELEASES = ROOT / "hack" / "releases.tsv"


def recorded_releases() -> dict[str, str]:
    """hack/releases.tsv: each release's tag and commit, for clones made without tags."""
    rows = (line.split("\t") for line in RELEASES.read_text().splitlines()
            if line.strip() and not line.startswith("#"))
    return {tag: commit for tag, commit in rows}


def contains(commit: str) -> bool:
    return git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def base_ref() -> str:
    """The version upgraded from: ACCELERATE_UPGRADE_FROM, else the newest release tag HEAD
    contains, else (a clone without tags, as CI makes) the newest release hack/releases.tsv
    records that HEAD contains. A tag and its record must agree. Fails, never skips, when
    there is no base."""
    ref = os.environ.get("ACCELERATE_UPGRADE_FROM")
    if ref:
        if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
            pytest.fail(f"ACCELERATE_UPGRADE_FROM={ref} is not a commit of this clone: fetch "
                        "it, or name a ref it has")
        return ref
    recorded = recorded_releases()
    tag = git("describe", "--tags", "--abbrev=0", "--match", "v*", "HEAD").stdout.strip()
    if tag:
        commit = git("rev-parse", f"{tag}^{{commit}}").stdout.strip()
        assert recorded.get(tag, commit) == commit, (
            f"tag {tag} is {commit} but hack/releases.tsv records {recorded[tag]}: "
            "record the tag's commit")
        return tag
    released = [commit for commit in recorded.values() if contains(commit)]
    if not released:
        shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        pytest.fail("no release to upgrade from: no v* tag at or before HEAD and no commit of "
                    f"hack/releases.tsv in this {'shallow ' if shallow else ''}clone: fetch the "
                    f"history (`git fetch {'--unshallow ' if shallow else ''}--tags origin`; "
                    "CI: actions/checkout with fetch-depth: 0), or set ACCELERATE_UPGRADE_FROM "
                    "to a ref to upgrade from")
    return released[-1]


def export(ref: str, dest: Path) -> None:
    """The base's tree, with the modes of a checkout (umask 022): buildah's layer cache keys a
    COPY on the files' modes too, and git archive's default umask (002) would miss it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "-c", "tar.umask=0022", "archive", ref],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def run_script(script: Path, kubeconfig: str, *args: str, **env: str) -> str:
    path = f"{Path(kubectl_binary()).parent}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KUBECONFIG": kubeconfig, "PATH": path, **env})
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-4000:]}"
    return done.stdout


def same_dependencies(tree: Path) -> bool:
    """Whether the base's pyproject.toml differs from today's in its version alone."""
    read = lambda root: re.sub(r"(?m)^version = .*$", "",  # noqa: E731
                               (root / "pyproject.toml").read_text())
    return read(tree) == read(ROOT)


def build_base_images(tree: Path, kubeconfig: str) -> None:
    """The base's operator and trainer-cpu images, built by its own hack/build-images.sh and
    loaded into the nodes. When the base's pyproject.toml differs from today's in its version
    alone, today's and its README.md replace the base's, so that, where the base's Dockerfiles
    build them as today's do, every dependency layer (torch, the libraries, deepspeed; the
    operator's venv) is one today's images already have and only the code layers are built:
    under a minute. Otherwise the base's own are built once on a machine, minutes, and cached."""
    if same_dependencies(tree):
        for name in ("pyproject.toml", "README.md"):
            shutil.copyfile(ROOT / name, tree / name)
    started = time.monotonic()
    run_script(tree / "hack" / "build-images.sh", kubeconfig, IMAGES="operator trainer-cpu",
               TAG=BASE_TAG)
    print(f"base images built in {time.monotonic() - started:.0f}s")
    run_script(ROOT / "hack" / "load-images.sh", kubeconfig, BASE_OPERATOR, BASE_TRAINER)


def deploy(tree: Path, kubeconfig: str, image: str) -> None:
    """The tree's chart installed over the release by its own hack/deploy-operator.sh; back
    once every running replica runs `image` and one of them is active."""
    tag = image.rsplit(":", 1)[1]
    env = {} if tree == ROOT else {"TAG": tag,
                                   "ACCELERATE_OPERATOR_HELM_ARGS": f"--set image.tag={tag}"}
    run_script(tree / "hack" / "deploy-operator.sh", kubeconfig, **env)

    def settled() -> bool:
        pods = kubectl_json("-n", OPERATOR_NAMESPACE, "get", "pods", "-l", OPERATOR_SELECTOR,
                            kubeconfig=kubeconfig)["items"]
        images = {c["image"] for p in pods for c in p["spec"]["containers"]}
        return images == {image} and bool(active_operator(kubeconfig)[0])

    wait_for(settled, timeout=180, interval=1, description=f"the operator on {image} alone")


@pytest.fixture
def base_operator(kubeconfig: str) -> Iterator[Path]:
    """The base version's operator deployed; today's deployed again afterwards, whatever
    happened, so that later tests run against it."""
    with tempfile.TemporaryDirectory(prefix="upgrade-base-") as tmp:
        tree = Path(tmp)
        export(base_ref(), tree)
        build_base_images(tree, kubeconfig)
        try:
            deploy(tree, kubeconfig, BASE_OPERATOR)
            yield tree
        finally:
            deploy(ROOT, kubeconfig, OPERATOR_IMAGE)


def upgrade_job() -> dict:
    return (JobBuilder.from_example(NAME).image(BASE_TRAINER)
            .run_policy(backoffLimit=2, stallTimeoutSeconds=STALL_TIMEOUT)
            .args("/opt/accelerate/examples/train.py", f"--max-steps={MAX_STEPS}",
                  f"--sleep-per-step={SLEEP_PER_STEP}", "--log-every=5")
            .build())


def pods_of(kubeconfig: str, namespace: str) -> list[dict]:
    return kubectl_json("-n", namespace, "get", "pods", "-l",
                        f"accelerate-operator.io/job-name={NAME}", kubeconfig=kubeconfig)["items"]


def test_a_job_of_the_previous_operator_trains_through_the_upgrade_with_no_restart(
        kubeconfig: str, base_operator: Path, namespace: str):
    apply_job(kubeconfig, namespace, upgrade_job())
    trained = wait_for_job(kubeconfig, namespace, NAME, lambda j: phase_is("Running")(j) and (
        j["status"].get("progress") or {}).get("step", 0) > 0, timeout=180,
        description="the job to train under the base operator")
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(kubeconfig, namespace)}
    assert len(before) == 2, before

    upgraded_at = time.monotonic()
    deploy(ROOT, kubeconfig, OPERATOR_IMAGE)
    took = time.monotonic() - upgraded_at
    print(f"upgraded in {took:.0f}s, "
          f"step {trained['status']['progress']['step']} before")
    kept = get_job(kubeconfig, namespace, NAME)["status"]
    assert kept["phase"] == "Running", f"the job ended before the upgrade was done: {kept}"

    job = wait_for_job(kubeconfig, namespace, NAME, phase_is("Succeeded", "Failed"),
                       timeout=300, description="the job to end under today's operator")
    status, trained_on = job["status"], time.monotonic() - upgraded_at - took
    print(f"trained {trained_on:.0f}s under today's operator")
    assert status["phase"] == "Succeeded", status
    assert trained_on > STALL_TIMEOUT, "the job ended too soon after the upgrade: raise MAX_STEPS"
    assert status.get("restarts", 0) == 0 and status.get("restartsCounted", 0) == 0, status
    assert "lastFailure" not in status, status
    raised = [c for c in status.get("conditions", [])
              if c["type"] in ("Restarting", "Stalled", "Failed") and c["status"] == "True"]
    assert not raised, raised
    # The old pods go on reporting to whichever operator is active: the progress is never
    # erased nor moved back.
    step = lambda s: (s.get("progress") or {}).get("step", 0)  # noqa: E731
    assert step(status) >= step(kept) > 0, (kept.get("progress"), status)
    after = pods_of(kubeconfig, namespace)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in after} == before
    restarted = {p["metadata"]["name"]: s["restartCount"] for p in after
                 for s in p["status"].get("containerStatuses", []) + p["status"].get(
                     "initContainerStatuses", []) if s["restartCount"]}
    assert not restarted, restarted
    images = {c["image"] for p in after for c in p["spec"]["containers"]}
    assert images == {BASE_TRAINER}, images
