"""`accelerate-job`: argument parsing, `submit --dry-run` output (whole objects, no cluster), the
status rendering, and errors that say what to do (exit 1, no traceback). The client is tested
against fake API objects: no cluster either."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import kubernetes
import pytest
import yaml
from accelerate_job import (
    AccelerateJobClient,
    JobFailed,
    JobNotFound,
    WaitTimeout,
    cli,
    render,
    submit,
    table,
)
from kubernetes.client.rest import ApiException

CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
use_cpu: true
mixed_precision: "no"
"""


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(CPU_CONFIG)
    return str(path)


# ---- parsing ------------------------------------------------------------------------------


def test_everything_after_the_script_belongs_to_the_script(config_file):
    args = cli.build_parser().parse_args([
        "submit", "--config", config_file, "--image", "img", "--nodes", "2",
        "--procs-per-node", "auto", "-n", "team", "train.py", "--config", "mine.json", "-n", "3",
    ])
    assert (args.script, args.script_args) == ("train.py", ["--config", "mine.json", "-n", "3"])
    assert (args.nodes, args.procs_per_node, args.namespace) == (2, "auto", "team")


@pytest.mark.parametrize("argv", [
    ["submit", "--config", "c.yaml", "--image", "i", "--nodes", "0", "t.py"],
    ["submit", "--config", "c.yaml", "--image", "i", "--procs-per-node", "many", "t.py"],
    ["submit", "--config", "c.yaml", "--image", "i", "--env", "NOEQUALS", "t.py"],
    ["submit", "--image", "i", "t.py"],
    ["logs", "job", "--node", "1", "--all"],
    ["status"],
])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    assert exited.value.code == 2


def test_logs_and_wait_defaults():
    args = cli.build_parser().parse_args(["logs", "j"])
    assert (args.node, args.all, args.follow, args.attempt) == (0, False, False, None)
    args = cli.build_parser().parse_args(["wait", "j"])
    assert (args.wait_for.condition, args.timeout) == ("Succeeded", 3600)


def test_default_names_are_dns_labels_from_the_script():
    assert submit.default_job_name("/opt/x/Train_LLM.py", "ab12c") == "train-llm-ab12c"
    assert submit.default_job_name("2stage.py", "ab12c") == "job-2stage-ab12c"


def test_run_as_a_kubectl_plugin_names_itself_so():
    assert cli.program_name("/usr/local/bin/kubectl-accelerate") == "kubectl accelerate"
    assert cli.program_name("accelerate-job") == "accelerate-job"


# ---- submit --dry-run ---------------------------------------------------------------------


def test_submit_dry_run_prints_the_configmap_and_the_job_whole(config_file):
    code, out, err = run(
        "submit", "--config", config_file, "--image", "trainer:cpu", "--nodes", "2",
        "--procs-per-node", "4", "--name", "llm", "-n", "team", "--env", "OMP_NUM_THREADS=1",
        "--backoff-limit", "1", "--dry-run", "-o", "yaml",
        "--in-image", "/opt/accelerate/examples/train.py", "--max-steps", "30",
    )
    assert (code, err) == (0, "")
    labels = {
        "app.kubernetes.io/name": "accelerate-job",
        "app.kubernetes.io/instance": "llm",
        "app.kubernetes.io/managed-by": "accelerate-operator",
        "accelerate-operator.io/job-name": "llm",
    }
    assert list(yaml.safe_load_all(out)) == [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "llm-accelerate-yaml", "namespace": "team", "labels": labels},
            "data": {"accelerate.yaml": CPU_CONFIG},
        },
        {
            "apiVersion": "accelerate-operator.io/v1alpha1",
            "kind": "AccelerateJob",
            "metadata": {"name": "llm", "namespace": "team"},
            "spec": {
                "numNodes": 2,
                "numProcPerNode": 4,
                "accelerateConfigFrom": {"configMapKeyRef": {"name": "llm-accelerate-yaml",
                                                             "key": "accelerate.yaml"}},
                "template": {"spec": {"containers": [{
                    "name": "trainer",
                    "image": "trainer:cpu",
                    "command": ["accelerate-trainer"],
                    "args": ["/opt/accelerate/examples/train.py", "--max-steps", "30"],
                    "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                }]}},
                "runPolicy": {"backoffLimit": 1},
            },
        },
    ]
    assert "accelerate.yaml: |\n" in out  # the config reads as the file it came from


def test_submit_dry_run_json_with_gpus_and_a_double_dash(config_file):
    code, out, _ = run("submit", "--config", config_file, "--image", "i", "--gpus", "8",
                       "--procs-per-node", "auto", "--name", "g", "-n", "x", "--dry-run",
                       "-o", "json", "--in-image", "t.py", "--", "--lr", "1")
    assert code == 0
    items = json.loads(out)["items"]
    container = items[1]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert container["args"] == ["t.py", "--lr", "1"]
    assert items[1]["spec"]["numProcPerNode"] == "auto"


def test_a_config_that_contradicts_the_flags_is_refused_before_anything_is_sent(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CPU_CONFIG + "num_machines: 3\n")
    code, out, err = run("submit", "--config", str(path), "--image", "i", "--nodes", "2",
                         "--name", "j", "-n", "x", "--dry-run", "--in-image", "t.py")
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {path}: ") and "num_machines" in err
    assert "Traceback" not in err


def test_a_missing_config_file_says_how_to_make_one():
    code, _, err = run("submit", "--config", "/nope/a.yaml", "--image", "i", "--dry-run", "t.py")
    assert code == 1
    assert err == ("error: cannot read --config /nope/a.yaml (No such file or directory); write "
                   "one with `accelerate config --config_file /nope/a.yaml`\n")


def test_a_config_or_deepspeed_json_that_is_not_utf8_is_named(tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_bytes(b"compute_environment: \xff\n")
    code, _, err = run("submit", "--config", str(config), "--image", "i", "--dry-run", "t.py")
    assert code == 1 and err.startswith(f"error: cannot read --config {config}: it is not "
                                        "UTF-8 text (invalid start byte at byte 21)")
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      "  deepspeed_config_file: ds.json\n")
    (tmp_path / "ds.json").write_bytes(b'{"x": "\xe9"}')
    code, _, err = run("submit", "--config", str(config), "--image", "i", "--dry-run", "t.py")
    assert code == 1 and err.startswith(f"error: cannot read {tmp_path / 'ds.json'}: it is "
                                        "not UTF-8 text")


@pytest.mark.parametrize(("content", "says"), [
    ("garbage: [\n", ""),  # what is wrong is YAML's own message
    ("- a\n- b\n", "it is not a kubeconfig (a YAML mapping of clusters, users and contexts)"),
    ("42\n", "it is not a kubeconfig"), (b"a: \xff\n", ""),
    (None, "Is a directory")])
def test_a_broken_kubeconfig_is_one_line_naming_the_file(tmp_path, content, says):
    path = tmp_path / "kubeconfig"
    if content is None:
        path.mkdir()
    else:
        getattr(path, "write_bytes" if isinstance(content, bytes) else "write_text")(content)
    code, out, err = run("get", "--kubeconfig", str(path))
    assert (code, out) == (1, "") and err.startswith(f"error: cannot use kubeconfig {path}: ")
    assert says in err and err.count("\n") == 1


# ---- status and errors through a fake client ----------------------------------------------


def job(phase="Running", progress=None, **status):
    return {
        "apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
        "metadata": {"name": "llm", "namespace": "team", "uid": "u1",
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"numNodes": 2, "template": {"spec": {"containers": [{"name": "trainer"}]}}},
        "status": {"phase": phase, "readyNodes": "2/2", "restarts": 1, "attempt": 1,
                   "progress": progress, **status},
    }


PROGRESS = {"step": 12, "totalSteps": 40, "epoch": 0.0, "loss": 2.3456, "samplesPerSecond": 81.5,
            "etaSeconds": 80, "eta": "1m20s", "summary": "12/40 (30%)"}


def test_status_shows_phase_nodes_restarts_progress_and_the_last_failure():
    failure = "pod llm-1 failed with exit code 1"
    text = render.render_status(job(progress=PROGRESS, lastFailure=failure))
    assert text == "\n".join([
        "Name:         llm (namespace team)",
        "Phase:        Running",
        "Nodes:        2/2 ready",
        "Restarts:     1 (attempt 1)",
        "Progress:     [#########.....................]  12/40 (30%)  epoch 0  loss 2.3456  "
        "81.5 samples/s  ETA 1m20s",
        "Last failure: pod llm-1 failed with exit code 1",
    ])


def test_the_watched_status_draws_the_same_rows_with_a_drawn_bar():
    failing = job(progress=PROGRESS, lastFailure="pod llm-1 failed with exit code 1")
    lines = render.to_text(render.status_view(failing)).splitlines()
    plain = render.render_status(failing).splitlines()
    progress = next(line for line in lines if line.startswith("Progress:"))
    assert "12/40 (30%)  epoch 0  loss 2.3456" in progress and "[" not in progress
    assert [line.rstrip() for line in lines if not line.startswith("Progress:")] == \
        [line for line in plain if not line.startswith("Progress:")]


def test_status_names_the_versions_the_trainer_reported():
    text = render.render_status(job(trainer={"attempt": 1, "versions": {
        "python": "3.11.9", "accelerate": "1.15.0", "torch": "2.15.0"}}))
    assert "Trainer:      python 3.11.9, accelerate 1.15.0, torch 2.15.0" in text.splitlines()


def test_status_shows_the_goodput_and_where_the_rest_went():
    goodput = {"percent": 87.5, "summary": "87.5%", "wallSeconds": 4800.0,
               "lostSeconds": {"waiting": 0.0, "startup": 15.0, "recovery": 540.0,
                               "recomputed": 45.0},
               "interruptions": 2, "lastRecoverySeconds": 21.0, "ledger": {"segment": "Training"}}
    text = render.render_status(job(goodput=goodput))
    assert ("Goodput:      87.5% of 1h20m kept; lost: recovery 9m, recomputed 45s, startup 15s "
            "(2 interruptions, the last recovered in 21s)") in text.splitlines()
    assert "ledger" not in render.summarize(job(goodput=goodput))["goodput"]
    assert "Goodput:" not in render.render_status(job())
    reduced = render.render_status(job(goodput={**goodput, "reducedSeconds": 1200.0,
                                                "summary": "87.5% (29% reduced)"}))
    assert "Goodput:      87.5% of 1h20m kept (20m of it reduced); lost: recovery 9m" in reduced


def test_status_before_any_report():
    assert render.progress_bar(None) == "no progress reported yet"


class FakeClient:
    namespace = "team"

    def __init__(self, jobs=(), error=None, versions=()):
        self.jobs = {j["metadata"]["name"]: j for j in jobs}
        self.error = error
        self.versions = list(versions)  # what the watches send after the current state

    def watch(self, name):
        yield self.get(name)
        yield from self.versions

    def watch_all(self, all_namespaces=False):
        self.all_namespaces = all_namespaces
        yield self.list()
        for version in self.versions:
            self.jobs[version["metadata"]["name"]] = version
            yield self.list()

    def get(self, name):
        if name not in self.jobs:
            raise JobNotFound(f"no AccelerateJob {name} in namespace team; list them with "
                              "`accelerate-job get`")
        return self.jobs[name]

    def list(self, all_namespaces=False, selector=None):
        self.all_namespaces, self.selector = all_namespaces, selector
        return [self.jobs[name] for name in sorted(self.jobs)]

    def wait(self, name, condition, timeout):
        raise self.error


def test_a_missing_job_says_how_to_list_them(fake):
    fake(FakeClient())
    assert run("status", "nope") == (
        1, "", "error: no AccelerateJob nope in namespace team; list them with "
               "`accelerate-job get`\n")


def test_status_prints_json_for_scripts(fake):
    fake(FakeClient([job(progress=PROGRESS)]))
    code, out, _ = run("status", "llm", "-o", "json")
    assert code == 0
    assert json.loads(out) == {
        "name": "llm", "namespace": "team", "phase": "Running", "readyNodes": "2/2",
        "restarts": 1, "attempt": 1, "lastFailure": None, "progress": PROGRESS,
        "goodput": None, "conditions": [],
    }


def test_status_watch_ends_with_the_job(fake):
    fake(FakeClient([job(phase="Succeeded", progress=PROGRESS)]))
    code, out, _ = run("status", "llm", "--watch")
    assert code == 0 and "Phase:        Succeeded" in out


def test_status_watch_prints_each_new_version_plainly_when_not_a_terminal(fake):
    later = job(progress={**PROGRESS, "step": 30, "summary": "30/40 (75%)"})
    failed = job(phase="Failed", progress=later["status"]["progress"])
    fake(FakeClient([job(progress=PROGRESS)], versions=[job(progress=PROGRESS), later, failed]))
    code, out, _ = run("status", "llm", "--watch")
    assert code == 1  # it failed
    blocks = out.split("\n\n")
    assert [b.splitlines()[1] for b in blocks] == ["Phase:        Running"] * 2 + [
        "Phase:        Failed"]  # an unchanged version is not printed again
    assert "30/40 (75%)" in blocks[1] and "\x1b[" not in out


def test_top_prints_the_table_with_bars_after_each_change_when_not_a_terminal(fake):
    other = {**job(phase="Queued"), "metadata": {**job()["metadata"], "name": "bert"}}
    fake(FakeClient([job(progress=PROGRESS)], versions=[other, job(phase="Succeeded", progress={
        **PROGRESS, "step": 40, "summary": "40/40 (100%)", "eta": "0s"})]))
    for command in (["top"], ["get", "-w"]):
        code, out, _ = run(*command)
        first, second, third = out.split("\n\n")
        assert first.splitlines()[0].split() == table.header()
        assert "━" in first and "12/40 (30%)" in first and "1m20s" in first
        assert [line.split()[:2] for line in third.splitlines()[1:]] == [
            ["bert", "Queued"], ["llm", "Succeeded"]]
        assert "40/40 (100%)" in third and "\x1b[" not in out
        fake(FakeClient([job(progress=PROGRESS)], versions=[other, job(
            phase="Succeeded", progress={**PROGRESS, "step": 40, "summary": "40/40 (100%)",
                                         "eta": "0s"})]))


def test_status_view_draws_a_bar_and_colours_the_phase():
    text = render.to_text(render.status_view(job(progress=PROGRESS)))
    assert "Phase:        Running" in text
    progress_line = next(line for line in text.splitlines() if line.startswith("Progress:"))
    assert "━" in progress_line and "12/40 (30%)  epoch 0" in progress_line


def cells(text: str) -> list[dict[str, str]]:
    """A table as kubectl prints it (left-aligned columns), read back by its header's places."""
    header, *lines = text.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return [{name: line[start:end].strip() for name, start, end
             in zip(names, starts, [*starts[1:], None], strict=True)} for line in lines]


def test_get_is_the_table_kubectl_get_prints(fake):
    fake(FakeClient([job(progress=PROGRESS)]))
    code, out, _ = run("get")
    assert out.splitlines()[0].split() == [
        "NAME", "PHASE", "REASON", "QUEUE", "TOPOLOGY", "SIZE", "READY", "RESTARTS", "COUNTED",
        "GOODPUT", "PROGRESS", "ETA", "AGE"] == table.header()
    (row,) = cells(out)
    assert {k: row[k] for k in ("NAME", "PHASE", "READY", "RESTARTS", "PROGRESS", "ETA")} == {
        "NAME": "llm", "PHASE": "Running", "READY": "2/2", "RESTARTS": "1",
        "PROGRESS": "12/40 (30%)", "ETA": "1m20s"}
    assert row["QUEUE"] == row["REASON"] == ""  # what the job's status lacks: kubectl's blank


def in_namespace(body, namespace, name=None):
    metadata = {**body["metadata"], "namespace": namespace,
                "name": name or body["metadata"]["name"]}
    return {**body, "metadata": metadata}


def test_get_all_namespaces_puts_the_namespace_first_as_kubectl_does(fake):
    client = fake(FakeClient([in_namespace(job(progress=PROGRESS), "team-a"),
                              in_namespace(job(phase="Queued"), "team-b", "bert")]))
    code, out, _ = run("get", "-A")
    header, *rows = out.splitlines()
    assert code == 0 and client.all_namespaces is True
    assert header.split() == ["NAMESPACE", *table.header()]
    assert [row.split()[:3] for row in rows] == [["team-b", "bert", "Queued"],
                                                 ["team-a", "llm", "Running"]]
    assert run("get", "--all-namespaces")[1] == out


def test_get_wide_adds_the_columns_kubectl_wide_adds(fake):
    fake(FakeClient([job(progress=PROGRESS, restartsCounted=0,
                         topology={"summary": "2x2", "masterPort": 29500},
                         trainer={"versions": {"accelerate": "1.15.0"}})]))
    code, out, _ = run("get", "-o", "wide")
    assert out.splitlines()[0].split() == table.header(wide=True)
    assert set(table.header(wide=True)) - set(table.header()) == {"PORT", "ACCELERATE"}
    (row,) = cells(out)
    assert [row[k] for k in ("TOPOLOGY", "PORT", "COUNTED", "QUEUE", "ACCELERATE")] == [
        "2x2", "29500", "0", "", "1.15.0"]


def test_get_never_cuts_a_cell_however_wide_the_table(fake):
    long = in_namespace(job(progress={**PROGRESS, "summary": "123456/1000000 (12%)"},
                            reason="AllNodesRunning", queue={"name": "team-nlp-a100-queue"},
                            topology={"summary": "16x8", "masterPort": 29500},
                            trainer={"versions": {"accelerate": "1.15.0"}}),
                        "a-rather-long-namespace-name",
                        "llama-3-70b-instruct-sft-lora-rank64-lr2e-5-run-2026-12-01")
    fake(FakeClient([long]))
    for argv in (("get",), ("get", "-A", "-o", "wide")):
        code, out, _ = run(*argv)
        assert "\u2026" not in out and out.splitlines()[0].split() == table.header(
            wide="wide" in argv, namespaces="-A" in argv)
        (row,) = cells(out)
        assert row["NAME"] == long["metadata"]["name"] and row["AGE"]
        assert row["PROGRESS"] == "123456/1000000 (12%)" and row["READY"] == "2/2"
    assert row["NAMESPACE"] == "a-rather-long-namespace-name" and row["ACCELERATE"] == "1.15.0"


def test_status_prints_yaml_for_scripts(fake):
    fake(FakeClient([job(progress=PROGRESS)]))
    code, out, _ = run("status", "llm", "-o", "yaml")
    assert yaml.safe_load(out) == render.summarize(job(progress=PROGRESS))


def test_status_watch_as_yaml_prints_one_document_per_change(fake):
    later = job(phase="Succeeded", progress={**PROGRESS, "step": 40, "summary": "40/40 (100%)"})
    fake(FakeClient([job(progress=PROGRESS)], versions=[later]))
    code, out, _ = run("status", "llm", "-w", "-o", "yaml")
    assert code == 0
    assert [d["phase"] for d in yaml.safe_load_all(out)] == ["Running", "Succeeded"]


def test_get_watch_as_json_is_refused_saying_what_works(fake):
    fake(FakeClient([job()]))
    code, out, err = run("get", "-w", "-o", "json")
    assert (code, out) == (1, "") and "`status NAME -w -o json`" in err


def test_top_watches_every_namespace_with_a():
    args = cli.build_parser().parse_args(["top", "-A", "-o", "wide"])
    assert (args.all_namespaces, args.output.kind) == (True, "wide")


def test_wait_for_a_failed_job_exits_1_with_the_reason(fake):
    fake(FakeClient(error=JobFailed("AccelerateJob llm failed (BackoffLimitExceeded): boom", {})))
    assert run("wait", "llm") == (1, "", "error: AccelerateJob llm failed "
                                        "(BackoffLimitExceeded): boom\n")


# ---- the client against fake API objects --------------------------------------------------


class WatchResponse:
    """What the API server streams for a watch: one JSON event per line."""

    status = 200

    def __init__(self, events):
        self.events = events

    def stream(self, amt=None, decode_content=False):
        for kind, body in self.events:
            yield (json.dumps({"type": kind, "object": body}) + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass


class FakeCustom:
    """The job's first version answers the get; the others come as watch events."""

    def __init__(self, bodies):
        self.bodies = list(bodies)
        self.watches = []
        self.cluster_lists = []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if not self.bodies:
            raise ApiException(status=404, reason="Not Found")
        return self.bodies[0]

    def list_cluster_custom_object(self, group, version, plural, **kwargs):
        self.cluster_lists.append(kwargs)
        return {"metadata": {"resourceVersion": "7"}, "items": list(self.bodies)}

    def list_namespaced_custom_object(self, group, version, namespace, plural, **kwargs):
        assert kwargs["watch"] and kwargs["_preload_content"] is False
        self.watches.append(kwargs)
        events = [("MODIFIED", body) for body in self.bodies[1:]]
        self.bodies[1:] = []
        return WatchResponse(events)


class FakeCore:
    def __init__(self, logs=None, configmaps=None):
        self.logs, self.configmaps = logs or {}, configmaps or {}

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None,
                                since_seconds=None):
        return self.logs[name]

    def read_namespaced_config_map(self, name, namespace):
        if name not in self.configmaps:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(data=self.configmaps[name])

    def list_namespaced_config_map(self, namespace, label_selector):
        return SimpleNamespace(items=[
            SimpleNamespace(metadata=SimpleNamespace(
                name=name, labels={"accelerate-operator.io/attempt": name.rsplit("-", 1)[1]}))
            for name in self.configmaps])


def client(bodies=(), core=None) -> AccelerateJobClient:
    c = AccelerateJobClient(namespace="team", api_client=kubernetes.client.ApiClient())
    c.requests.custom, c.requests.core = FakeCustom(bodies), core or FakeCore()
    return c


def failed_condition(message):
    return [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
             "message": message}]


def test_wait_follows_the_job_with_a_watch_until_the_condition_holds():
    done = job(phase="Succeeded", conditions=[{"type": "Succeeded", "status": "True"}])
    c = client([job(), job(), done])
    assert c.wait("llm") == done
    watch, = c.requests.custom.watches
    assert watch["field_selector"] == "metadata.name=llm" and watch["timeout_seconds"] >= 1


def test_watch_ends_when_the_job_is_deleted():
    c = client([job()])
    c.requests.custom.list_namespaced_custom_object = (
        lambda *a, **k: WatchResponse([("DELETED", job())]))
    with pytest.raises(JobNotFound, match="llm was deleted"):
        list(c.watch("llm"))


def test_watch_reads_the_job_again_when_its_version_expired():
    answers = [WatchResponse([("ERROR", {"code": 410, "reason": "Expired", "message": "old"})]),
               WatchResponse([("MODIFIED", job(phase="Succeeded"))])]
    c = client([job()])
    c.requests.custom.list_namespaced_custom_object = lambda *a, **k: answers.pop(0)
    phases = [j["status"]["phase"] for _, j in zip(range(3), c.watch("llm"), strict=False)]
    assert phases == ["Running", "Running", "Succeeded"]


def test_list_of_every_namespace_asks_the_cluster_and_sorts_by_namespace():
    jobs = [in_namespace(job(), "b"), in_namespace(job(), "a", "zeta"), in_namespace(job(), "a")]
    c = client(jobs)
    assert [(j["metadata"]["namespace"], j["metadata"]["name"])
            for j in c.list(all_namespaces=True)] == [("a", "llm"), ("a", "zeta"), ("b", "llm")]
    assert len(c.requests.custom.cluster_lists) == 1


def test_watch_of_every_namespace_tells_same_named_jobs_apart():
    c = client([in_namespace(job(), "a")])
    events = [("ADDED", in_namespace(job(phase="Queued"), "b")),
              ("MODIFIED", in_namespace(job(phase="Succeeded"), "a"))]
    c.requests.custom.list_cluster_custom_object = lambda *a, **k: (
        WatchResponse(events) if k.get("watch") else
        {"metadata": {"resourceVersion": "1"}, "items": [in_namespace(job(), "a")]})
    states = [[(j["metadata"]["namespace"], j["status"]["phase"]) for j in jobs]
              for _, jobs in zip(range(3), c.watch_all(all_namespaces=True), strict=False)]
    assert states == [[("a", "Running")], [("a", "Running"), ("b", "Queued")],
                      [("a", "Succeeded"), ("b", "Queued")]]


def test_wait_raises_job_failed_with_the_condition_message():
    failed = job(phase="Failed", conditions=failed_condition("pod llm-1 failed; no restarts left"))
    with pytest.raises(JobFailed, match=r"failed \(BackoffLimitExceeded\): pod llm-1 failed; "
                                        "no restarts left"):
        client([failed]).wait("llm")


def test_wait_escapes_what_the_job_says_as_status_does(fake):
    hostile = "pod llm-0 failed: \x1b]0;pwned\x07\x1b[2J"
    failed = job(phase="Failed", conditions=failed_condition(hostile))
    with pytest.raises(JobFailed) as raised:
        client([failed]).wait("llm")
    assert "\x1b" not in str(raised.value) and "\\x1b]0;pwned\\x07\\x1b[2J" in str(raised.value)
    fake(client([failed]))
    code, out, err = run("wait", "llm", "--for=condition=Succeeded")
    assert code == 1 and "\\x1b]0;pwned" in err and "\x1b" not in err
    code, out, err = run("wait", "llm", "--for=jsonpath={.status.conditions[0].message}=ok")
    assert code == 1 and "\\x1b]0;pwned" in err and "\x1b" not in err


def test_wait_times_out_saying_where_the_job_is():
    with pytest.raises(WaitTimeout, match=r"still Running at 12/40 \(30%\) after 0.05s"):
        client([job(progress=PROGRESS)]).wait("llm", timeout=0.05)


def test_logs_of_all_nodes_are_prefixed():
    core = FakeCore(logs={"llm-0": "a\nb\n", "llm-1": "c\n"})
    assert client([job()], core).logs("llm", node="all") == "[node 0] a\n[node 0] b\n[node 1] c\n"


def test_logs_of_an_attempt_come_from_the_archive():
    core = FakeCore(configmaps={"llm-logs-attempt-0": {"llm-0.log": "x\n", "llm-1.log": "y\n"}})
    assert client([job()], core).logs("llm", node=1, attempt=0) == "y\n"


def test_logs_of_an_attempt_never_archived_list_the_archived_ones():
    core = FakeCore(configmaps={"llm-logs-attempt-0": {}})
    with pytest.raises(Exception, match=r"no archived logs for attempt 5 .* \(archived: 0\)"):
        client([job()], core).logs("llm", attempt=5)


def test_a_node_out_of_range_is_named():
    with pytest.raises(Exception, match="has 2 node.s.: pick a node from 0 to 1"):
        client([job()]).logs("llm", node=2)


def yaml_counted_job(nodes=3):
    """A job whose node count came from its accelerate YAML: submit leaves spec.numNodes out,
    the operator writes status.topology.numNodes."""
    body = job(topology={"numNodes": nodes, "summary": f"{nodes}x1"}, readyNodes=None)
    body["spec"].pop("numNodes")
    return body


def test_the_node_count_is_the_operators_topology_before_the_spec():
    core = FakeCore(logs={"llm-0": "a\n", "llm-1": "b\n", "llm-2": "c\n"},
                    configmaps={"llm-logs-attempt-0": {"llm-2.log": "z\n"}})
    c = client([yaml_counted_job()], core)
    assert c.logs("llm", node="all") == "[node 0] a\n[node 1] b\n[node 2] c\n"
    assert c.logs("llm", node=2) == "c\n" and c.logs("llm", node=2, attempt=0) == "z\n"
    with pytest.raises(Exception, match="has 3 node.s.: pick a node from 0 to 2"):
        c.logs("llm", node=3)
    assert "Nodes:        0/3 ready" in render.render_status(yaml_counted_job())


# ---- accelerate's own templates, as a user would submit them ------------------------------------


def test_submit_picks_up_the_deepspeed_json_the_config_names():
    """accelerate's deepspeed template names ../deepspeed_config_templates/zero_stage1_config.json:
    it is read beside the YAML and shipped in the same ConfigMap; no topology flag is written."""
    from tests.helpers.corpus import DEEPSPEED_JSONS, TEMPLATES

    code, out, err = run("submit", "--config", str(TEMPLATES / "deepspeed.yaml"), "--image", "i",
                         "--name", "ds", "-n", "x", "--dry-run", "-o", "json", "--in-image",
                         "t.py")
    assert code == 0, err
    configmap, job = json.loads(out)["items"]
    assert configmap["data"]["zero_stage1_config.json"] == (
        DEEPSPEED_JSONS / "zero_stage1_config.json").read_text()
    assert not {"numNodes", "numProcPerNode", "masterPort"} & set(job["spec"])


def test_submit_of_a_deepspeed_config_whose_json_is_missing_is_refused(tmp_path):
    from tests.helpers.corpus import TEMPLATES

    path = tmp_path / "deepspeed.yaml"
    path.write_text((TEMPLATES / "deepspeed.yaml").read_text())
    code, out, err = run("submit", "--config", str(path), "--image", "i", "--name", "ds",
                         "-n", "x", "--dry-run", "--in-image", "t.py")
    assert code == 1 and out == ""
    assert "zero_stage1_config.json' is not shipped with the config" in err


def test_submit_of_the_multi_node_template_takes_its_topology_from_the_yaml():
    from tests.helpers.corpus import TEMPLATES

    code, out, err = run("submit", "--config", str(TEMPLATES / "multi_node.yaml"), "--image", "i",
                         "--name", "mn", "-n", "x", "--dry-run", "-o", "json", "--in-image",
                         "t.py")
    assert code == 0, err
    spec = json.loads(out)["items"][1]["spec"]
    assert not {"numNodes", "numProcPerNode", "masterPort"} & set(spec)


# ---- job text is printed, never acted on ----------------------------------------------------
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31m[/bold] [red]x\u202e\r"
SHOWN = "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m[/bold] [red]x\\u202e\\x0d"


def test_every_printer_shows_job_text_escaped_and_never_as_markup():
    """What pods and users wrote reaches status, describe, the tables and the live view with its
    escape codes written out and its brackets as they are (a `[/bold]` would otherwise be a rich
    closing tag that raises)."""
    from datetime import datetime, timezone

    from accelerate_job import describe

    hostile = job(progress={**PROGRESS, "summary": HOSTILE}, lastFailure=HOSTILE,
                  conditions=[{"type": "Running", "status": "True", "reason": "R",
                               "message": HOSTILE}],
                  trainer={"versions": {"accelerate": HOSTILE}}, queue={"name": HOSTILE})
    now = datetime(2026, 1, 1, 0, 5, tzinfo=timezone.utc)
    events = [{"type": "Warning", "reason": "ProcessFailed", "message": HOSTILE}]
    texts = {
        "status": render.render_status(hostile),
        "wide": render.render_wide_status(hostile),
        "view": render.to_text(render.status_view(hostile), width=400),
        "table": render.render_table([hostile], now, bars=True, wide=True),
        "describe": describe.render_describe(hostile, [], events, now),
    }
    for name, text in texts.items():
        assert not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f
                       or c == "\u202e" for c in text), name
    for name in ("status", "wide", "view", "describe"):
        assert SHOWN in texts[name], name
    assert "[/bold] [red]x" in texts["table"]
    assert texts["describe"].count(SHOWN) == 4  # the message, the condition, the failure, the event
