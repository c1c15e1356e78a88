"""The operator-trainer contract (accelerate_trainer.contract) read from both ends: what the
operator's builders write, the trainer parses, and what the trainer prints, the operator reads."""

from __future__ import annotations

import io
from datetime import datetime

from accelerate_operator.api import parse_job
from accelerate_operator.lifecycle import run_lifecycle
from accelerate_operator.progress import build_progress_status, parse_report
from accelerate_operator.resources.configmap import build_configmap
from accelerate_operator.resources.pods import build_pod
from accelerate_trainer import contract
from accelerate_trainer.progress import ProgressReporter
from accelerate_trainer.report_push import Reports, encode
from accelerate_trainer.topology import parse_topology

from tests.helpers.jobs import JobBuilder, pod


def test_the_trainer_reads_its_place_from_the_env_the_operator_sets():
    job = parse_job(JobBuilder("llm").nodes(3).procs(2).build())
    container = build_pod(job, 2, attempt=0)["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    topology = parse_topology(env)
    assert (topology.node_rank, topology.num_nodes, topology.nproc_per_node,
            topology.world_size) == (2, 3, 2, 6)
    assert topology.master_addr == "llm-0.llm"


def test_the_trainer_finds_the_config_where_the_operator_mounts_it():
    job = parse_job(JobBuilder("llm").build())
    manifest = build_pod(job, 0, attempt=0)
    mount = next(m for m in manifest["spec"]["containers"][0]["volumeMounts"]
                 if m["mountPath"] == contract.CONFIG_MOUNT_PATH)
    volume = next(v for v in manifest["spec"]["volumes"] if v["name"] == mount["name"])
    # The whole ConfigMap, every key a file of its own name: config.yaml and the files beside it.
    assert volume["configMap"] == {"name": "llm-accelerate-config"}
    assert contract.CONFIG_KEY in build_configmap(job, {})["data"]
    assert parse_topology({**{e["name"]: e["value"] for e in
                              manifest["spec"]["containers"][0]["env"]}}).config_file == \
        contract.CONFIG_FILE


def test_a_progress_line_the_trainer_prints_is_one_the_operator_reads():
    stream = io.StringIO()
    ProgressReporter(stream=stream, enabled=True).report(step=3, total_steps=10, loss=0.5)
    reports = Reports()  # pod 0's supervisor: the output in, the annotation's value out
    reports.feed(1, ("some output\n" + stream.getvalue() + "more output\n").encode(), 0.0)
    report = parse_report(encode(reports.current))
    assert build_progress_status(report.progress, datetime(2026, 1, 1))["summary"] == "3/10 (30%)"


def test_a_report_names_its_attempt_and_a_relaunch_drops_the_last_attempts_progress():
    """Restarted in place, pod 0's progress of attempt 4 must not pass for attempt 5's."""
    reports = Reports()
    reports.launched(4)
    reports.feed(1, b'ACCELERATE_PROGRESS {"step": 29}\n', 100.0)
    report = parse_report(encode(reports.current))
    assert (report.attempt, report.step) == (4, 29)
    reports.launched(5)
    report = parse_report(encode(reports.current))
    assert (report.attempt, report.step, report.progress) == (5, None, None)
    # ... but names attempt 4's last step and its time: where the recovery began.
    assert (report.previous_step, report.previous_time) == (29, datetime(1970, 1, 1, 0, 1, 40))
    assert report.last_output is not None  # the last sign of life stays: stall detection


def test_the_trainer_config_exit_code_fails_the_job_at_once():
    job = parse_job(JobBuilder("llm").nodes(1).build())
    plan = run_lifecycle(job, {"phase": "Running", "attempt": 0}, [
        pod("llm", 0, "Failed", exit_code=contract.CONFIG_ERROR_EXIT_CODE)], datetime(2026, 1, 1))
    assert plan.status["phase"] == "Failed" and plan.status["restarts"] == 0


def test_pods_carry_the_label_keys_of_the_contract():
    labels = build_pod(parse_job(JobBuilder("llm").build()), 1, attempt=4)["metadata"]["labels"]
    assert (labels[contract.JOB_NAME_LABEL], labels[contract.NODE_INDEX_LABEL],
            labels[contract.ATTEMPT_LABEL]) == ("llm", "1", "4")


def test_a_failed_launchs_root_cause_the_trainer_reports_is_one_the_operator_reads():
    import json
    from pathlib import Path

    from accelerate_operator.pod_state import read_process_exit
    from accelerate_trainer.root_cause import from_launch

    captured = Path(__file__).parent / "launch_failures" / "sigkill_rank_1" / "launch-report.json"
    cause = from_launch(json.loads(captured.read_text()), oom_kills=1, memory_limit=300 * 2**20)
    reports = Reports(progress=False)
    reports.launched(2)
    reports.feed(2, b"Traceback ...\ntorchrun's summary\n", 1.0)
    reports.ended(2, 1, 2.0, cause)
    ended = read_process_exit(encode(reports.current), "llm-1")
    assert (ended.attempt, ended.exit_code, ended.message) == (2, 1, "Traceback ...\n"
                                                                     "torchrun's summary")
    first, _, rest = cause.text.partition("\n")
    assert ended.cause.startswith("out of memory") and ended.oom
    assert ended.cause == f"{first} (pod llm-1, rank 1)" + (f"\n{rest}" if rest else "")
    assert set(cause.report()) == set(contract.EXIT_ROOT_CAUSE_FIELDS)


def test_printable_text_drops_whole_escape_sequences_and_keeps_what_a_redraw_left():
    colours = "\x1b[31;1mRuntimeError\x1b[0m: boom \x1b]8;;https://x\x1b\\link\x1b]8;;\x1b\\"
    bar = "  0%|          | 0/9\r 50%|#####     | 4/9\r100%|##########| 9/9\r\n"
    text = contract.printable_text(colours + "\n" + bar + "done", 200)
    assert text == "RuntimeError: boom link\n100%|##########| 9/9\ndone"
    assert contract.printable_text("a\r" + "b" * 300 + "\rcd", 10) == "cd"  # before the cut
