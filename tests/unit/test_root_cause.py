"""Root causes of real failed launches: tests/unit/launch_failures/ holds what `accelerate launch`
(torch's elastic agent, gloo, 2 CPU processes) and the trainer's launch hook wrote for each way a
launch fails (devtools/capture_launch_failures.py captured them), and root_cause.py must name the
first failing rank's own error from them, not torchrun's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accelerate_trainer import root_cause

CASES = Path(__file__).parent / "launch_failures"


def record(case: str) -> dict | None:
    return json.loads((CASES / case / "launch-report.json").read_text())


def cause(case: str, **memory) -> root_cause.RootCause:
    found = root_cause.from_launch(record(case), **memory)
    assert found is not None
    return found


def test_every_captured_launch_failed_as_its_name_says():
    for case in CASES.iterdir():
        assert (case / "exit-code").read_text().strip() != "0", case.name
        assert record(case.name) is not None, f"{case.name}: the launcher's hook wrote nothing"


def test_an_exception_in_one_rank_names_that_rank_its_error_and_the_lines_above_it():
    found = cause("exception_in_rank_1")
    lines = found.text.splitlines()
    assert lines[0] == "ValueError: bad batch 7 on rank 1"
    assert "raise ValueError(f'bad batch {batch} on rank {rank}')" in lines[-1]
    assert any("in step" in line for line in lines[1:])
    assert (found.rank, found.signal, found.reason) == (1, None, None)
    # rank 0 failed too (gloo: connection closed by the dead peer), later: not the cause
    assert "Connection closed" not in found.text


def test_a_script_path_typo_gives_pythons_own_line():
    found = cause("script_path_typo")
    assert found.text.endswith("can't open file '/work/trian.py': [Errno 2] No such file or "
                               "directory")
    assert "\n" not in found.text and found.rank in (0, 1)


def test_an_import_error_names_the_missing_module_and_the_import_line():
    found = cause("import_error")
    assert found.text.splitlines()[0] == "ModuleNotFoundError: No module named 'transformerz'"
    assert "import transformerz" in found.text


def test_a_gloo_timeout_names_the_rank_that_timed_out_not_the_one_torchrun_stopped():
    found = cause("gloo_timeout")
    assert found.rank == 0
    assert found.text.startswith("RuntimeError: ") and "Timed out" in found.text.splitlines()[0]
    assert "all_reduce" in found.text


def test_a_rank_killed_by_sigkill_is_named_with_its_signal():
    found = cause("sigkill_rank_1")
    assert (found.rank, found.signal, found.reason) == (1, "SIGKILL", None)
    assert found.text == "rank 1 was killed by SIGKILL"


def test_a_sigkill_the_cgroup_counted_as_an_oom_kill_says_out_of_memory_with_the_limit():
    found = cause("sigkill_rank_1", oom_kills=1, memory_limit=300 * 2**20)
    assert found.reason == "OOMKilled" and (found.rank, found.signal) == (1, "SIGKILL")
    assert found.text.startswith("out of memory")
    assert "memory limit 300Mi (314572800 bytes)" in found.text and "rank 1" in found.text
    assert found.report() == {"rootCause": found.text, "rank": 1, "signal": "SIGKILL",
                              "reason": "OOMKilled", "oomKills": 1,
                              "memoryLimitBytes": 314572800}


@pytest.mark.parametrize("case", ["rendezvous_timeout_static", "rendezvous_timeout_c10d",
                                  "rendezvous_timeout_static_worker"])
def test_a_group_that_never_formed_says_the_rendezvous_did_not_complete(case):
    if not (CASES / case).is_dir():
        pytest.skip(f"{case} not captured")
    found = cause(case)
    assert found.reason == "RendezvousTimeout"
    assert found.text.startswith("the rendezvous did not complete: ")
    assert found.rank is None and found.signal is None


def test_no_record_and_no_oom_kill_is_no_root_cause():
    assert root_cause.from_launch(None) is None
    assert root_cause.from_launch({"failures": []}) is None


def test_an_oom_kill_without_a_record_still_says_out_of_memory():
    found = root_cause.from_launch(None, oom_kills=2, memory_limit=None)
    assert found is not None and found.reason == "OOMKilled" and found.oom_kills == 2
    assert "no memory limit" in found.text and "a process of this pod" in found.text


def test_the_report_leaves_out_what_is_not_known():
    assert cause("import_error").report().keys() == {"rootCause", "rank"}


def test_a_rank_that_lost_its_peer_says_so_as_a_symptom_not_a_cause():
    """Pod 0 of a 2-pod job whose rank 1 died: its own launcher sees only rank 0, which failed
    on gloo's closed connection (the captured failure, as pod 0 records it)."""
    survivor = next(f for f in record("exception_in_rank_1")["failures"] if f["rank"] == 0)
    found = root_cause.from_launch({"failures": [{**survivor, "signal": None}]})
    assert (found.rank, found.reason) == (0, root_cause.PEER_LOST)
    assert found.text.startswith("rank 0 lost a peer (another rank, or its pod, failed first): "
                                 "RuntimeError: ")
    # killed for memory itself: that is the cause, whatever its error said
    assert root_cause.from_launch({"failures": [survivor]}, oom_kills=1).reason == \
        root_cause.OOM_KILLED
