"""The elastic policy (resize.py) in the pass: its steps one by one over explicit Facts (the
placement it reads for each situation, the resize it decides, the placeholders it keeps), then
whole passes against the fake API (tests/helpers/fake_kube.py) from a lost node to a shrunk group
and back to full size. The sizes and the accumulation are test_elastic.py's."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from accelerate_operator.api import parse_job
from accelerate_operator.elastic import at_size
from accelerate_operator.kube import Rejected
from accelerate_operator.lifecycle import run_lifecycle
from accelerate_operator.not_started import NotStarted
from accelerate_operator.outcome import Counters, Facts
from accelerate_operator.pod_state import NodeState
from accelerate_operator.resize import placed, placement, resize
from accelerate_operator.status import StatusBuilder
from accelerate_operator.timefmt import format_time, utcnow

from tests.helpers import passes
from tests.helpers.fake_kube import FakeKube
from tests.helpers.jobs import JobBuilder, pod
from tests.helpers.passes import NOW

NO_ROOM = "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) were unschedulable"


def elastic(nodes=2, min_nodes=1, accumulation=2, **fields):
    return parse_job(JobBuilder("j").nodes(nodes).elastic(min_nodes, accumulation, **fields)
                     .build())


def unschedulable(index: int, seconds: float, attempt: int = 0):
    """Pod j-<index>, Pending: the scheduler has found no node for it for `seconds`."""
    since = format_time(NOW - timedelta(seconds=seconds))
    return replace(pod("j", index, "Pending", attempt=attempt),
                   not_started=NotStarted("Unschedulable", NO_ROOM, since=since))


def placeholder(index: int, phase: str = "Running", **fields):
    return replace(pod("j", index, phase, node="n2" if phase == "Running" else None),
                   name=f"j-placeholder-{index}", attempt=-1, **fields)


def facts(job, pods=(), status=None, placeholders=(), **fields) -> Facts:
    return Facts(job, status or {}, tuple(pods), NOW, placeholders=tuple(placeholders),
                 **fields)


RUNNING = {"phase": "Running", "attempt": 1}
REDUCED = {**RUNNING, "elastic": {"nodes": 1, "wantedNodes": 2, "resizes": 1,
                                  "lastResizeTime": "2026-01-01T11:00:00Z"},
           "conditions": [{"type": "Resized", "status": "True", "reason": "PodsUnschedulable",
                           "message": "", "lastTransitionTime": "2026-01-01T11:00:00Z"}]}


# ---- what the scheduler did with the group's pods, for each situation ----------------------
def test_a_group_whose_pods_are_all_bound_is_placed_whole():
    f = facts(elastic(), [pod("j", 0, node="n1"), pod("j", 1, node="n2")])
    assert placement(f, f.pods) == placement(f, f.pods).__class__(2, None, ())


def test_an_unschedulable_pod_is_named_with_the_schedulers_words_and_timed_from_its_condition():
    f = facts(elastic(), [pod("j", 0, node="n1"), unschedulable(1, 30)])
    found = placement(f, f.pods)
    assert (found.placed, found.unplaceable_since) == (1, NOW - timedelta(seconds=30))
    assert found.why == (f"pod j-1 cannot be scheduled: Unschedulable: {NO_ROOM}",)


def test_a_pod_on_a_lost_node_or_on_its_way_out_is_not_placed():
    f = facts(elastic(), [pod("j", 0, node="gone"), pod("j", 1, node="n2", deleting=True)],
              lost_nodes={"gone": NodeState("gone", None, reporting=False)})
    assert placement(f, f.pods).placed == 0


def test_a_pod_pending_for_another_reason_is_not_unschedulable():
    pulling = replace(pod("j", 1, "Pending", node="n2"),
                      not_started=NotStarted("ErrImagePull", "nope"))
    f = facts(elastic(), [pod("j", 0, node="n1"), pulling])
    assert placement(f, f.pods).unplaceable_since is None


def test_only_running_ready_placeholders_count_as_placed():
    assert placed([placeholder(1), placeholder(2, "Pending"),
                   placeholder(3, deleting=True)]) == 1


# ---- the resize the policy decides ---------------------------------------------------------
def resize_of(f: Facts):
    out = StatusBuilder(f.job, f.status, f.now)
    return resize(f, out, Counters.of(f.status)), out


def test_before_the_wait_the_group_is_left_to_its_policy_and_the_pass_asks_back_in_time():
    (outcome, due), out = resize_of(facts(elastic(), [pod("j", 0, "Pending", node="n1"),
                                                       unschedulable(1, 50)], {"attempt": 0}))
    assert (outcome, due) == (None, 70.0)
    assert out.status["elastic"] == {"nodes": 2, "wantedNodes": 2, "summary": "2/2",
                                     "gradientAccumulationSteps": 2, "resizes": 0}


def test_past_the_wait_the_group_restarts_at_the_size_that_fits_as_an_uncounted_disruption():
    f = facts(elastic(), [pod("j", 0, "Running", node="n1"), unschedulable(1, 120)],
              {"phase": "Restarting", "attempt": 1, "restarts": 1, "restartsCounted": 0})
    f = replace(f, pods=tuple(replace(p, attempt=1) for p in f.pods))
    (outcome, _), _ = resize_of(f)
    status = outcome.status
    # The group never formed (j-1 was never placed): nothing to save, and j-0 only waits for
    # its peer. Both go with no grace period.
    assert (outcome.attempt, outcome.delete, outcome.force_delete) == (2, (), ("j-0", "j-1"))
    assert (status["restarts"], status["restartsCounted"], status["phase"]) == (
        2, 0, "Restarting")
    assert status["elastic"] == {"nodes": 1, "wantedNodes": 2, "summary": "1/2",
                                 "gradientAccumulationSteps": 4, "resizes": 1,
                                 "lastResizeTime": "2026-01-01T12:00:00Z"}
    resized = next(c for c in status["conditions"] if c["type"] == "Resized")
    assert (resized["status"], resized["reason"]) == ("True", "PodsUnschedulable")
    (event,) = outcome.events
    assert (event.type, event.reason) == ("Warning", "PodsUnschedulable")
    assert f"pod j-1 cannot be scheduled: Unschedulable: {NO_ROOM}" in event.message
    assert "at 1 of 2 nodes with gradient accumulation 4" in event.message


def test_a_reduced_group_grows_back_when_its_placeholder_runs_stopping_gracefully():
    job = at_size(elastic(), 1)
    f = facts(job, [pod("j", 0, attempt=1, node="n1")], REDUCED, [placeholder(1)])
    (outcome, _), _ = resize_of(f)
    assert (outcome.delete, outcome.force_delete) == (("j-0",), ())  # every rank saves
    assert outcome.status["elastic"]["nodes"] == 2
    resized = next(c for c in outcome.status["conditions"] if c["type"] == "Resized")
    assert (resized["status"], resized["reason"]) == ("False", "CapacityReturned")
    assert [(e.type, e.reason) for e in outcome.events] == [("Normal", "CapacityReturned")]
    assert outcome.status["restartsCounted"] == 0


def test_a_reduced_group_does_not_grow_while_its_placeholder_waits_or_it_does_not_run_whole():
    job = at_size(elastic(), 1)
    waiting = facts(job, [pod("j", 0, attempt=1)], REDUCED, [placeholder(1, "Pending")])
    assert resize_of(waiting)[0] == (None, None)
    failing = facts(job, [pod("j", 0, "Failed", attempt=1)], REDUCED, [placeholder(1)])
    assert resize_of(failing)[0] == (None, None)


def test_a_group_still_waiting_for_its_predecessor_to_go_is_not_resized():
    f = facts(elastic(), [pod("j", 0, attempt=0, deleting=True), unschedulable(1, 600, 1)],
              {"phase": "Restarting", "attempt": 1})
    assert resize_of(f)[0] == (None, None)


def test_a_job_that_is_not_elastic_has_no_elastic_status():
    f = facts(parse_job(JobBuilder("j").build()), [unschedulable(1, 600)], {"attempt": 0})
    (outcome, due), out = resize_of(f)
    assert (outcome, due) == (None, None) and "elastic" not in out.status


# ---- the placeholders it keeps, whichever policy ended the pass ----------------------------
def lifecycle(job, pods, status, placeholders=(), **spec):
    return run_lifecycle(job, status, pods, NOW, placeholders=placeholders)


def test_a_reduced_group_that_runs_gets_a_placeholder_per_missing_node():
    job = at_size(elastic(4, 1, 1), 1)
    status = {**RUNNING, "elastic": {"nodes": 1, "wantedNodes": 4}}
    outcome = lifecycle(job, [pod("j", 0, attempt=1)], status, [placeholder(2, "Pending")])
    assert (outcome.placeholders, outcome.delete) == ((1, 3), ())
    starting = lifecycle(job, [pod("j", 0, "Pending", attempt=1)],
                         {**status, "phase": "Pending"})
    assert starting.placeholders == ()  # none takes a node the group's own pod needs


def test_placeholders_go_at_full_size_when_the_job_finishes_and_when_it_is_suspended():
    job = at_size(elastic(), 1)
    kept = [placeholder(1)]
    done = lifecycle(job, [pod("j", 0, "Succeeded", attempt=1)], REDUCED, kept)
    assert ("j-placeholder-1" in done.delete, done.placeholders) == (True, ())
    suspended = replace(job, run_policy=replace(job.run_policy, suspend=True))
    assert "j-placeholder-1" in lifecycle(suspended, [], REDUCED, kept).delete
    whole = lifecycle(elastic(), [pod("j", 0), pod("j", 1)], RUNNING, kept)
    assert "j-placeholder-1" in whole.delete


def test_a_placeholder_that_ended_is_replaced_once_its_name_is_free():
    job = at_size(elastic(), 1)
    ended = lifecycle(job, [pod("j", 0, attempt=1)], REDUCED, [placeholder(1, "Failed")])
    assert (ended.delete, ended.placeholders) == (("j-placeholder-1",), ())
    freed = lifecycle(job, [pod("j", 0, attempt=1)], REDUCED, [])
    assert freed.placeholders == (1,)


# ---- whole passes: a lost node, the shrink, the placeholder, the growth ----------------------
class Cluster(passes.Cluster):
    """The shared harness (the placeholders given to each pass apart from the pods, as the
    controller's two indexes give them), with what these passes do to the pods."""

    @property
    def status(self) -> dict:
        return self.body["status"]

    def pod(self, name: str) -> dict:
        return self.kube.objects[("Pod", name)]

    def env(self, name: str) -> dict[str, str]:
        container = self.pod(name)["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    def unschedulable(self, name: str, seconds: float) -> None:
        since = format_time(utcnow() - timedelta(seconds=seconds))
        self.pod(name)["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": NO_ROOM, "lastTransitionTime": since}]}

    def run(self, name: str, node: str) -> None:
        self.kube.set_pod_phase(name, "Running")
        self.pod(name)["spec"]["nodeName"] = node


def test_a_job_whose_replacement_pod_cannot_be_placed_shrinks_then_grows_back():
    cluster = Cluster(JobBuilder("j").nodes(2).elastic(1, 2, shrinkAfterSeconds=60).build())
    cluster.reconcile()
    assert cluster.kube.names("Pod") == ["j-0", "j-1"]
    assert cluster.env("j-1")["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    cluster.run("j-0", "n1")
    cluster.unschedulable("j-1", 50)
    assert 9.0 <= cluster.reconcile() <= 10.0  # asked back when the wait is over
    assert cluster.status["elastic"]["summary"] == "2/2"

    cluster.unschedulable("j-1", 61)
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert ("force-delete", "Pod", "j-0") in cluster.kube.calls  # the group never formed
    assert cluster.status["elastic"]["summary"] == "1/2" and cluster.status["restartsCounted"] == 0
    assert [e.reason for e in cluster.kube.events][-1] == "PodsUnschedulable"
    cluster.reconcile()  # the old group is gone: the smaller one is created
    assert cluster.kube.names("Pod") == ["j-0"]
    env = cluster.env("j-0")
    assert (env["NUM_NODES"], env["WORLD_SIZE"]) == ("1", "2")
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"

    cluster.run("j-0", "n1")
    cluster.reconcile()
    assert cluster.status["phase"] == "Running"
    assert cluster.kube.names("Pod") == ["j-0", "j-placeholder-1"]
    cluster.reconcile()
    assert cluster.kube.names("Pod") == ["j-0", "j-placeholder-1"]  # kept, not made twice

    cluster.run("j-placeholder-1", "n2")  # the capacity is back
    cluster.kube.calls.clear()
    cluster.reconcile()
    assert ("delete", "Pod", "j-0") in cluster.kube.calls  # gracefully: every rank saves
    assert cluster.kube.names("Pod") == []  # the group stopped to save, the placeholder gone
    assert cluster.status["elastic"]["summary"] == "2/2"
    assert [e.type for e in cluster.kube.events][-1] == "Normal"
    cluster.reconcile()
    assert cluster.kube.names("Pod") == ["j-0", "j-1"]
    assert cluster.env("j-1")["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert cluster.status["topology"]["summary"] == "2x2"  # the size it wants, all along


class NoPriorityClass(FakeKube):
    """A cluster without the PriorityClass accelerate-operator-placeholder (a plain-manifests
    install that left it out): the API server refuses every placeholder."""

    async def create_if_absent(self, manifest):
        if "placeholder" in manifest["metadata"]["name"]:
            self.calls.append(("create", "Pod", manifest["metadata"]["name"]))
            raise Rejected("Pod", "pods is forbidden: no PriorityClass with name "
                                  "accelerate-operator-placeholder was found")
        return await super().create_if_absent(manifest)


def test_a_refused_placeholder_fails_nothing_and_is_named_once_in_a_warning():
    cluster = Cluster(JobBuilder("j").nodes(2).elastic(1, 2).build(), NoPriorityClass())
    cluster.body["status"] = {"phase": "Restarting", "attempt": 1,
                              "elastic": {"nodes": 1, "wantedNodes": 2}}
    cluster.reconcile()
    cluster.run("j-0", "n1")
    cluster.reconcile()
    cluster.reconcile()
    assert cluster.status["phase"] == "Running"
    refused = [e for e in cluster.kube.events if e.reason == "PlaceholderRejected"]
    assert len(refused) == 1 and "no PriorityClass with name" in refused[0].message
    assert cluster.kube.calls.count(("create", "Pod", "j-placeholder-1")) == 2  # tried again
