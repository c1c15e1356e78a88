"""`accelerate-job` in kubectl's habits: global flags anywhere, durations, `-o` formats, `wait
--for`, several names and -l, `get`, `describe`, `logs -c/-p/--since`. Parsing is argparse's
(real parsers); the commands run against a fake client (no cluster: the e2e test
tests/e2e/test_cli_kubectl.py runs the same commands against the local cluster)."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone

import pytest
import yaml
from accelerate_job import JobNotFound, cli, describe
from accelerate_job.jsonpath import TemplateError, compile_template
from accelerate_job.options import duration


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def usage_error(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv), out=io.StringIO(), err=io.StringIO())
    assert exited.value.code == 2
    return capsys.readouterr().err


# ---- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["-n", "ml", "top"], ["top", "-n", "ml"], ["-n", "other", "get", "-n", "ml"],
    ["--namespace=ml", "get", "a"], ["get", "a", "--namespace", "ml"],
])
def test_the_namespace_goes_before_or_after_the_command(argv):
    assert parse(*argv).namespace == "ml"


def test_every_global_flag_is_taken_before_the_command_and_kept():
    args = parse("--kubeconfig", "/k", "--context", "c", "-A", "-o", "wide", "get")
    assert (args.kubeconfig, args.context, args.all_namespaces, args.output.kind) == (
        "/k", "c", True, "wide")
    args = parse("get", "--kubeconfig=/k", "--context=c", "-A", "-owide")
    assert (args.kubeconfig, args.context, args.all_namespaces, args.output.kind) == (
        "/k", "c", True, "wide")
    assert (parse("get").namespace, parse("get").all_namespaces) == (None, False)


@pytest.mark.parametrize(("text", "seconds"), [
    ("10m", 600), ("1h30m", 5400), ("2.5s", 2.5), ("300ms", 0.3), ("0", 0), ("0s", 0),
    ("1h", 3600),
])
def test_durations_are_kubectls(text, seconds):
    assert duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["10 minutes", "m", "-5s", "10x", "", "300"])
def test_a_bad_duration_is_a_usage_error_naming_the_form(text, capsys):
    err = usage_error("wait", "a", f"--timeout={text}", capsys=capsys)
    assert "must be a duration with its unit, such as 30s, 10m or 1h30m" in err


def test_wait_takes_kubectls_for_and_timeout_and_several_names():
    args = parse("wait", "--for=condition=Succeeded", "--timeout=10m", "a", "b")
    assert (args.names, args.wait_for.kind, args.wait_for.condition, args.timeout) == (
        ["a", "b"], "condition", "Succeeded", 600)
    assert parse("wait", "a", "--for=delete").wait_for.kind == "delete"
    target = parse("wait", "-l", "team=x", "--for=jsonpath={.status.phase}=Running").wait_for
    assert (target.kind, target.template.source, target.value) == (
        "jsonpath", "{.status.phase}", "Running")
    assert parse("wait", "a", "--for=jsonpath={.status.progress}").wait_for.value is None


@pytest.mark.parametrize("target", ["condition=Done", "Bogus", "Succeeded", "jsonpath={.a[}=1",
                                    "jsonpath={.status.phase}Running"])
def test_a_bad_wait_target_is_a_usage_error(target, capsys):
    assert "--for" in usage_error("wait", "a", f"--for={target}", capsys=capsys)


@pytest.mark.parametrize(("argv", "says"), [
    (["top", "-o", "json"], "top prints text, wide"),
    (["-o", "jsonpath={.x}", "status", "a"], "status prints text, wide, json, yaml"),
    (["logs", "a", "-o", "yaml"], "logs takes no -o"),
    (["get", "-o", "table"], "get prints wide, name, json, yaml, jsonpath=TEMPLATE"),
    (["get", "-o", "json=1"], "json takes no =VALUE"),
])
def test_an_output_a_command_does_not_print_is_a_usage_error(argv, says, capsys):
    assert says in usage_error(*argv, capsys=capsys)


def test_logs_takes_c_p_and_since():
    args = parse("logs", "a", "-c", "sidecar", "-p", "--since", "2m")
    assert (args.container, args.previous, args.since, args.attempt) == ("sidecar", True, 120,
                                                                          None)
    assert parse("logs", "a", "--attempt", "2").attempt == 2


def test_previous_and_attempt_do_not_mix(capsys):
    assert "not allowed with" in usage_error("logs", "a", "-p", "--attempt", "1", capsys=capsys)


# ---- jsonpath -----------------------------------------------------------------------------


def test_jsonpath_templates_read_as_kubectl_prints_them():
    data = {"kind": "List", "items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}],
            "status": {"conditions": [{"type": "Succeeded", "status": "True"}], "ok": True}}
    assert compile_template("{.items[*].metadata.name}").render(data) == "a b"
    assert compile_template("n={.items[0].metadata.name};").render(data) == "n=a;"
    assert compile_template(
        '{.status.conditions[?(@.type=="Succeeded")].status}').render(data) == "True"
    assert compile_template("{.status.ok}").render(data) == "true"
    assert compile_template("{.status.conditions[0]}").render(data) == json.dumps(
        {"type": "Succeeded", "status": "True"})


def test_jsonpath_string_literals_and_escaped_dots_are_kubectls():
    data = {"items": [{"metadata": {"name": "a", "annotations": {
        "kubectl.kubernetes.io/last-applied-configuration": "{}", "app/x": "y"}}}]}
    assert compile_template(
        '{.items[0].metadata.name}{"\\t"}{"text"}{\'\\n\'} {"}"}').render(data) == "a\ttext\n }"
    assert compile_template(
        r"{.items[0].metadata.annotations.kubectl\.kubernetes\.io/last-applied-configuration}"
    ).render(data) == "{}"
    assert compile_template("{.items[*].metadata.annotations.app/x}").render(data) == "y"


@pytest.mark.parametrize("template", ["{range .items[*]}{.x}{end}", "{.a", "", "{.a[}"])
def test_a_template_jsonpath_cannot_read_says_how_to_write_one(template):
    with pytest.raises(TemplateError, match="jsonpath='{.status.phase}'"):
        compile_template(template)


# ---- the commands against a fake client ---------------------------------------------------


def ajob(name, phase="Running", namespace="team", labels=None, **status):
    return {"apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"numNodes": 1},
            "status": {"phase": phase, "conditions": [
                {"type": phase, "status": "True", "reason": phase,
                 "lastTransitionTime": "2026-01-01T00:01:00Z", "message": f"it is {phase}"}],
                **status}}


class Client:
    """A client's jobs and what was asked of it; watch() plays `versions[name]` after the
    job's current state, then ends (a timeout) or, for a name in `deleted`, raises JobNotFound
    as the real watch does."""

    namespace = "team"

    def __init__(self, *jobs, versions=None, deleted=(), archived=()):
        self.jobs = {job["metadata"]["name"]: job for job in jobs}
        self.versions, self.deleted_while_watched = versions or {}, set(deleted)
        self.archived, self.calls = list(archived), []

    def get(self, name):
        if name not in self.jobs:
            raise JobNotFound(f"no AccelerateJob {name} in namespace team")
        return self.jobs[name]

    def list(self, all_namespaces=False, selector=None):
        self.calls.append(("list", all_namespaces, selector))
        key, _, value = (selector or "").partition("=")
        return [job for _, job in sorted(self.jobs.items())
                if not selector or job["metadata"]["labels"].get(key) == value]

    def delete(self, name):
        self.calls.append(("delete", name))
        self.jobs.pop(name)

    def watch(self, name, timeout=None):
        self.calls.append(("watch", name, timeout))
        yield self.get(name)
        yield from self.versions.get(name, [])
        if name in self.deleted_while_watched:
            raise JobNotFound(f"AccelerateJob {name} was deleted")

    def wait(self, name, condition, timeout):
        self.calls.append(("wait", name, condition, timeout))
        return self.get(name)

    def archived_attempts(self, name):
        return self.archived

    def logs(self, name, **kwargs):
        self.calls.append(("logs", name, kwargs))
        return "a line\n"


def test_get_prints_one_job_or_every_job_as_kubectl_does(fake):
    fake(Client(ajob("a"), ajob("b", "Succeeded")))
    code, out, _ = run("get")
    assert code == 0 and out.splitlines()[0].split() == [
        "NAME", "PHASE", "REASON", "QUEUE", "TOPOLOGY", "SIZE", "READY", "RESTARTS", "COUNTED",
        "GOODPUT", "PROGRESS", "ETA", "AGE"]
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["a", "Running"],
                                                                   ["b", "Succeeded"]]
    assert run("get", "b", "-o", "name") == (
        0, "acceleratejob.accelerate-operator.io/b\n", "")
    assert json.loads(run("-o", "json", "get", "b")[1])["metadata"]["name"] == "b"
    listed = yaml.safe_load(run("get", "a", "b", "-o", "yaml")[1])
    assert (listed["kind"], [j["metadata"]["name"] for j in listed["items"]]) == (
        "List", ["a", "b"])
    assert run("get", "-o", "jsonpath={.items[*].status.phase}") == (
        0, "Running Succeeded", "")


def test_get_of_a_missing_job_says_so(fake):
    fake(Client())
    assert run("get", "nope") == (1, "", "error: no AccelerateJob nope in namespace team\n")


def test_a_selector_picks_the_jobs_of_get_and_delete(fake):
    client = fake(Client(ajob("a", labels={"team": "x"}), ajob("b"), ajob("c", labels={
        "team": "x"})))
    assert run("get", "-l", "team=x", "-o", "name")[1].count("\n") == 2
    assert run("delete", "-l", "team=x") == (
        0, "acceleratejob/a deleted\nacceleratejob/c deleted\n", "")
    assert sorted(client.jobs) == ["b"] and ("list", False, "team=x") in client.calls


def test_delete_takes_several_names(fake):
    client = fake(Client(ajob("a"), ajob("b"), ajob("c")))
    assert run("delete", "a", "c")[0] == 0
    assert sorted(client.jobs) == ["b"]


@pytest.mark.parametrize(("argv", "says"), [
    (["delete"], "name the jobs to delete (delete NAME...), or select them with -l"),
    (["delete", "a", "-l", "x=y"], "name the jobs or select them with -l x=y, not both"),
    (["get", "a", "-A"], "a name works in one namespace: drop -A, and give the namespace"),
    (["delete", "-A", "-l", "x=y"], "delete works in one namespace: drop -A"),
    (["wait"], "name the jobs to wait for"),
])
def test_names_and_selectors_that_cannot_work_are_refused_saying_why(fake, argv, says):
    client = fake(Client(ajob("a")))
    code, _, err = run(*argv)
    assert code == 1 and says in err and "a" in client.jobs


def test_wait_for_a_condition_of_several_jobs_within_one_timeout(fake):
    client = fake(Client(ajob("a", "Succeeded"), ajob("b", "Succeeded")))
    code, out, _ = run("wait", "--for=condition=Succeeded", "--timeout=10m", "a", "b")
    assert (code, out) == (0, "acceleratejob/a condition met: Succeeded (Succeeded)\n"
                              "acceleratejob/b condition met: Succeeded (Succeeded)\n")
    timeouts = [call[3] for call in client.calls if call[0] == "wait"]
    assert len(timeouts) == 2 and 599 < timeouts[1] <= timeouts[0] <= 600


def test_wait_for_a_jsonpath_follows_the_job_until_it_matches(fake):
    fake(Client(ajob("a", "Pending"), versions={"a": [ajob("a", "Running")]}))
    assert run("wait", "a", "--for=jsonpath={.status.phase}=Running") == (
        0, "acceleratejob/a condition met: jsonpath {.status.phase}=Running (Running)\n", "")


def test_wait_for_a_jsonpath_a_finished_job_can_never_reach_ends_at_once(fake):
    fake(Client(ajob("a", "Failed")))
    code, _, err = run("wait", "a", "--for=jsonpath={.status.phase}=Running")
    assert code == 1 and "is Failed and will not change: {.status.phase} is Failed" in err


def test_wait_for_a_jsonpath_that_never_matches_times_out(fake):
    fake(Client(ajob("a", "Pending")))
    code, _, err = run("wait", "a", "--for=jsonpath={.status.phase}=Running", "--timeout=0")
    assert code == 1 and "still Pending after 0s" in err


def test_wait_for_delete_ends_when_the_job_is_gone(fake):
    fake(Client(ajob("a"), deleted={"a"}))
    assert run("wait", "a", "--for=delete") == (0, "acceleratejob/a deleted\n", "")
    fake(Client(ajob("a")))
    code, _, err = run("wait", "a", "--for=delete", "--timeout=1s")
    assert code == 1 and "still exists after 1s" in err


def test_wait_for_a_selector_that_selects_nothing_says_so(fake):
    fake(Client(ajob("a")))
    code, _, err = run("wait", "-l", "team=none")
    assert code == 1 and "no AccelerateJob matches -l team=none" in err


def test_logs_previous_reads_the_last_archived_attempt(fake):
    client = fake(Client(ajob("a"), archived=[0, 1]))
    assert run("logs", "a", "-p", "-c", "trainer", "--since", "90s") == (0, "a line\n", "")
    assert client.calls[-1][2] | {} == {"node": 0, "follow": False, "attempt": 1,
                                         "tail_lines": None, "container": "trainer",
                                         "since_seconds": 90}


def test_logs_previous_without_an_archive_says_where_the_earlier_attempts_are(fake):
    fake(Client(ajob("a")))
    code, _, err = run("logs", "a", "--previous")
    assert code == 1 and "no previous attempt archived" in err and "`logs a`" in err


def test_describe_tells_the_story_of_a_job():
    job = ajob("a", "Restarting", restarts=1, attempt=1,
               lastFailure="pod a-0 failed: exit code 1\nTraceback\nValueError: boom")
    pods = [{"metadata": {"name": "a-0", "creationTimestamp": "2026-01-01T00:02:00Z"},
             "spec": {"nodeName": "node-1", "containers": [{"name": "trainer"}]},
             "status": {"phase": "Running", "containerStatuses": [
                 {"ready": True, "restartCount": 0}]}}]
    events = [{"type": "Warning", "reason": "ProcessFailed", "count": 2,
               "lastTimestamp": "2026-01-01T00:03:00Z", "source": {"component": "op"},
               "message": "rank 1 exited 1"}]
    text = describe.render_describe(job, pods, events,
                                    datetime(2026, 1, 1, 0, 5, tzinfo=timezone.utc))
    lines = text.splitlines()
    assert "Created:      2026-01-01T00:00:00Z (5m ago)" in lines
    assert lines[lines.index("Conditions:") + 2].split()[:4] == [
        "Restarting", "True", "Restarting", "4m"]
    failure = lines.index("Last failure:")
    assert lines[failure + 1:failure + 4] == ["  pod a-0 failed: exit code 1", "  Traceback",
                                             "  ValueError: boom"]
    assert lines[lines.index("Pods:") + 2].split() == ["a-0", "Running", "1/1", "0", "node-1",
                                                       "3m"]
    assert lines[lines.index("Events:") + 2].split() == [
        "Warning", "ProcessFailed", "2m", "(x2)", "op", "rank", "1", "exited", "1"]


def test_describe_of_a_job_with_nothing_yet_says_none(fake):
    assert describe.render_describe(ajob("a", "Pending"), [], [], datetime.now(timezone.utc)
                                    ).endswith("Pods:\n  <none> (not created yet, or cleaned "
                                               "up)\nEvents:\n  <none>")


def test_status_wide_adds_the_table_columns_its_block_does_not_show(fake):
    fake(Client(ajob("a", topology={"summary": "2x4", "masterPort": 29500},
                     queue={"name": "team-q"})))
    code, out, _ = run("status", "a", "-o", "wide")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "Name:         a (namespace team)"
    assert lines[-7:] == ["Reason:       -", "Queue:        team-q", "Topology:     2x4",
                          "Port:         29500", "Size:         -", "Counted:      -",
                          "Accelerate:   -"]
    assert any(line.startswith("Restarts:") for line in lines)  # the attempt is said there
