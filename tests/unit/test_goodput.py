"""status.goodput over whole job histories: each pass's Moment applied to the stored ledger, as
the operator does, and the totals it shows."""

from __future__ import annotations

from datetime import datetime, timedelta

from accelerate_operator.goodput import Moment, update_goodput

T0 = datetime(2026, 1, 1, 12, 0, 0)


class History:
    """A job's passes in order: each `at(seconds, ...)` is one status write."""

    def __init__(self) -> None:
        self.goodput: dict | None = None
        self.phase, self.attempt = "Pending", 0

    def at(self, seconds: float, phase: str | None = None, *, attempt: int | None = None,
           step: int | None = None) -> dict:
        after_phase = phase or self.phase
        after_attempt = self.attempt if attempt is None else attempt
        moment = Moment(T0 + timedelta(seconds=seconds), T0, self.phase, after_phase,
                        self.attempt, after_attempt, step)
        self.goodput = update_goodput(self.goodput, moment)
        self.phase, self.attempt = after_phase, after_attempt
        return self.goodput


def lost(waiting=0.0, startup=0.0, recovery=0.0, recomputed=0.0, idle=0.0):
    return {"waiting": waiting, "startup": startup, "recovery": recovery,
            "recomputed": recomputed, "idle": idle}


def test_a_run_without_faults_loses_its_wait_its_startup_and_the_time_after_its_last_step():
    job = History()
    job.at(10, "Running")
    job.at(25, step=1)
    for second, step in ((50, 40), (75, 80), (100, 120)):
        job.at(second, step=step)
    done = job.at(105, "Succeeded")
    assert done["lostSeconds"] == lost(waiting=10.0, startup=15.0, idle=5.0)
    assert (done["wallSeconds"], done["productiveSeconds"]) == (105.0, 75.0)
    assert (done["percent"], done["summary"], done["interruptions"]) == (71.4, "71.4%", 0)
    assert "lastRecoverySeconds" not in done
    # A finished job's goodput no longer moves.
    assert {k: v for k, v in job.at(500)["lostSeconds"].items()} == done["lostSeconds"]
    assert job.goodput["wallSeconds"] == 105.0


def test_a_crash_costs_its_recovery_and_the_steps_trained_again():
    job = History()
    job.at(0, "Running")
    job.at(5, step=1)
    job.at(60, step=40)  # the last report before rank 2 dies
    job.at(62, "Restarting", attempt=1)
    shown = job.at(75, "Running")
    assert shown["lostSeconds"]["recovery"] == 15.0  # open: from the last report, so far
    job.at(80, step=32)  # resumed from the checkpoint at step 30
    job.at(84, step=40)  # steps 33..40 again
    job.at(86, step=44)  # new ground
    done = job.at(100, "Succeeded")
    assert done["lostSeconds"] == lost(startup=5.0, recovery=20.0, recomputed=4.0, idle=14.0)
    assert (done["interruptions"], done["lastRecoverySeconds"]) == (1, 20.0)
    assert done["productiveSeconds"] == 57.0


def test_a_step_written_with_the_restart_was_trained_before_the_fault():
    """The write limiter held pod 0's last report back; the pass that restarts the group writes
    it: training went on until that step, and the recovery begins there."""
    job = History()
    job.at(0, "Running")
    job.at(5, step=1)
    job.at(30, "Restarting", attempt=1, step=21)
    job.at(35, "Running")
    job.at(45, step=22)
    done = job.at(50, "Succeeded")
    assert done["lostSeconds"]["recovery"] == 15.0 and done["lastRecoverySeconds"] == 15.0


def test_restarted_in_place_the_recovery_begins_at_the_last_step_pod_0_saw():
    """The last report written said step 40 at 60 s; pod 0 trained on to step 48 at 68 s, which
    its first report of attempt 1 names: the recovery runs from there, and steps 33..48 are
    trained again."""
    job = History()
    job.at(0, "Running")
    job.at(5, step=1)
    job.at(60, step=40)
    job.at(69, "Restarting", attempt=1)
    job.at(70, "Running")
    moment = Moment(T0 + timedelta(seconds=80), T0, "Running", "Running", 1, 1, 32,
                    T0 + timedelta(seconds=80), 48, T0 + timedelta(seconds=68))
    job.goodput = update_goodput(job.goodput, moment)
    job.at(88, step=48)
    done = job.at(90, "Succeeded")
    assert done["lostSeconds"] == lost(startup=5.0, recovery=12.0, recomputed=8.0, idle=2.0)
    assert done["lastRecoverySeconds"] == 12.0


def test_a_report_that_crosses_the_highest_step_counts_only_the_steps_below_it():
    job = History()
    job.at(0, "Running")
    job.at(10, step=50)
    job.at(11, "Restarting", attempt=1)
    job.at(20, "Running")
    job.at(30, step=40)
    shown = job.at(40, step=60)  # 40 -> 60 in 10 s: half of it below 50
    assert shown["lostSeconds"]["recomputed"] == 5.0


def test_two_faults_before_the_first_step_are_two_interruptions_of_one_recovery():
    job = History()
    job.at(0, "Running")
    job.at(10, step=10)
    job.at(12, "Restarting", attempt=1)
    job.at(30, "Restarting", attempt=2)  # the new group failed before its first step
    job.at(40, "Running")
    shown = job.at(50, step=12)
    assert (shown["interruptions"], shown["lastRecoverySeconds"]) == (2, 40.0)
    assert shown["lostSeconds"]["recovery"] == 40.0


def test_a_script_that_reports_no_step_kept_nothing_however_long_its_pods_ran():
    """Only time in which steps advance is productive: a script that reports none (a wrong
    script path failing each attempt, or one that prints no progress) shows 0.0%, not the share
    of its time its pods were running."""
    job = History()
    job.at(20, "Running")
    job.at(100, "Restarting", attempt=1)
    job.at(130, "Running")
    done = job.at(200, "Succeeded")
    assert done["lostSeconds"] == lost(waiting=20.0, startup=80.0, recovery=100.0)
    assert (done["percent"], done["summary"], done["lastRecoverySeconds"]) == (0.0, "0.0%", 100.0)
    failing = History()
    for second in range(0, 10, 2):  # each attempt runs 1 s, then fails
        failing.at(second + 1, "Running")
        failing.at(second + 2, "Restarting", attempt=second // 2 + 1)
    assert failing.at(11, "Failed")["percent"] == 0.0


def test_reports_of_a_step_that_did_not_advance_are_idle_time():
    job = History()
    job.at(0, "Running")
    job.at(5, step=10)
    job.at(15, step=10)  # a long evaluation: no step in 10 s
    shown = job.at(20, step=12)
    assert shown["lostSeconds"] == lost(startup=5.0, idle=10.0)
    assert shown["productiveSeconds"] == 5.0


def test_training_at_a_reduced_size_is_productive_and_shown_apart():
    """An elastic job shrinks (a restart: recovery), trains reduced, grows back (a restart),
    and trains whole: the reduced training counts, and the summary says its share."""
    job = History()
    job.at(0, "Running")
    job.at(10, step=10)  # startup 10
    job.at(30, step=30)
    job.at(40, "Restarting", attempt=1)  # shrunk: recovery from step 30 at 30 s
    job.at(50, "Running")
    reduced = Moment(T0 + timedelta(seconds=60), T0, "Running", "Running", 1, 1, 31,
                     reduced=True)
    job.goodput = update_goodput(job.goodput, reduced)  # recovery 30 s
    job.goodput = update_goodput(job.goodput, Moment(
        T0 + timedelta(seconds=90), T0, "Running", "Running", 1, 1, 40, reduced=True))
    shown = job.at(90, "Restarting", attempt=2)  # grown back, at the checkpoint of step 40
    assert shown["reducedSeconds"] == 30.0
    job.at(95, "Running")
    job.at(100, step=41)
    done = job.at(120, step=60)
    assert done["lostSeconds"] == lost(startup=10.0, recovery=40.0)
    assert (done["productiveSeconds"], done["reducedSeconds"]) == (70.0, 30.0)
    assert done["summary"] == "58.3% (43% reduced)"
    assert "reducedSeconds" not in History().at(5, "Running")


def test_a_job_that_fails_before_reporting_a_step_kept_nothing():
    job = History()
    job.at(20, "Running")
    done = job.at(30, "Failed")
    assert done["lostSeconds"] == lost(waiting=20.0, startup=10.0)
    assert (done["percent"], done["summary"]) == (0.0, "0.0%")


def test_a_kueue_eviction_is_an_interruption_and_a_suspension_is_waiting():
    job = History()
    job.at(0, "Running")
    job.at(10, step=10)
    job.at(20, "Queued", attempt=1)  # evicted
    job.at(50, "Running")
    job.at(60, step=12)
    job.at(70, "Suspended")
    job.at(100, "Pending", attempt=2)  # resumed
    job.at(110, "Running")
    shown = job.at(115, step=14)
    assert shown["interruptions"] == 1
    # The 10 s from the last step to the suspension were idle.
    assert shown["lostSeconds"] == lost(waiting=40.0, startup=15.0, recovery=50.0, idle=10.0)


def test_a_step_is_timed_by_when_pod_0_saw_it_not_when_the_operator_read_it():
    job = History()
    job.at(10, "Running")
    # The first step came at 22 s; the operator wrote it at 26 s (its write interval).
    moment = Moment(T0 + timedelta(seconds=26), T0, "Running", "Running", 0, 0, 1,
                    T0 + timedelta(seconds=22))
    shown = update_goodput(job.goodput, moment)
    assert shown["lostSeconds"]["startup"] == 12.0
    # A pod clock ahead of the operator's is kept to now; one behind, to the last boundary.
    ahead = Moment(T0 + timedelta(seconds=26), T0, "Running", "Running", 0, 0, 1,
                   T0 + timedelta(seconds=40))
    assert update_goodput(job.goodput, ahead)["lostSeconds"]["startup"] == 16.0
    behind = Moment(T0 + timedelta(seconds=26), T0, "Running", "Running", 0, 0, 1, T0)
    assert update_goodput(job.goodput, behind)["lostSeconds"]["startup"] == 0.0


def test_the_ledger_survives_a_round_trip_through_the_status():
    """A restarted operator goes on from the stored status: the same totals."""
    job = History()
    job.at(0, "Running")
    job.at(5, step=1)
    stored = job.at(30, step=20)
    assert stored["ledger"]["segment"] == "Training"
    assert stored["ledger"]["highestStep"] == 20
    again = update_goodput(stored, Moment(T0 + timedelta(seconds=30), T0, "Running", "Running",
                                          0, 0, None))
    assert again == stored


def test_a_job_that_ran_before_goodput_existed_starts_its_ledger_now():
    """Upgrading the operator under a running job: its past is unknown, not all waiting."""
    now = T0 + timedelta(hours=2)
    running = update_goodput(None, Moment(now, T0, "Running", "Running", 3, 3, 500, now))
    assert running["lostSeconds"] == lost()
    assert running["percent"] == 100.0 and running["ledger"]["segment"] == "Training"
    restarting = update_goodput(None, Moment(now, T0, "Restarting", "Restarting", 4, 4))
    assert restarting["ledger"]["segment"] == "Recovery"
