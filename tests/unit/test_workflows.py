"""The GitHub workflows, read as GitHub reads them: every `run` step runs under `shell: bash`
(GitHub's `bash --noprofile --norc -eo pipefail {0}`; without it a step runs `bash -e {0}`, and
a failure inside a pipe, `check | tail`, passes), and the release publishes nothing (no job that
may write packages, releases or pages) before its unit tests and its smoke run have passed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

WORKFLOWS = sorted((Path(__file__).resolve().parents[2] / ".github" / "workflows").glob("*.y*ml"))
RELEASE = next(p for p in WORKFLOWS if p.stem == "release")
WRITES = {"packages", "contents", "pages", "id-token", "attestations"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def shells(workflow: dict) -> dict[str, str | None]:
    """{job/step: the shell its run step gets}, from the step, the job's or the workflow's
    defaults."""
    default = ((workflow.get("defaults") or {}).get("run") or {}).get("shell")
    found = {}
    for job_id, job in workflow["jobs"].items():
        job_default = ((job.get("defaults") or {}).get("run") or {}).get("shell", default)
        for number, step in enumerate(job.get("steps") or []):
            if "run" in step:
                found[f"{job_id}/{step.get('name', number)}"] = step.get("shell", job_default)
    return found


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_run_step_fails_on_a_failure_inside_a_pipe(path):
    workflow = load(path)
    assert shells(workflow), f"{path.name} runs nothing"
    without = [step for step, shell in shells(workflow).items() if shell != "bash"]
    assert not without, f"{path.name}: set `defaults: {{run: {{shell: bash}}}}`: {without}"


def needs(jobs: dict, job_id: str) -> set[str]:
    """Every job `job_id` waits for, directly or through others."""
    direct = jobs[job_id].get("needs") or []
    direct = [direct] if isinstance(direct, str) else direct
    return set(direct).union(*(needs(jobs, other) for other in direct))


def test_the_release_publishes_only_after_its_unit_tests_and_smoke_run():
    jobs = load(RELEASE)["jobs"]
    publishing = [job_id for job_id, job in jobs.items()
                  if any(job.get("permissions", {}).get(scope) == "write" for scope in WRITES)]
    assert publishing
    assert {"unit", "smoke"} <= set(jobs)
    early = {job_id: sorted({"unit", "smoke"} - needs(jobs, job_id)) for job_id in publishing
             if not {"unit", "smoke"} <= needs(jobs, job_id)}
    assert not early, f"these jobs may publish before the tests pass: {early}"
