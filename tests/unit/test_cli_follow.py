"""The client's watches and log follower against fake API objects (no cluster): a dropped watch
is watched again from its last resourceVersion, as kubectl's retry watcher does, until the
server stays unreachable; a log follower that ends leaves no thread and no open watch behind;
what the log call refuses is said as the server says it, on stderr with exit 1 when following.
"""

from __future__ import annotations

import io
import json
import threading

import kubernetes
import pytest
import urllib3
from accelerate_job import AccelerateJobClient, AccelerateJobError, cli, request
from kubernetes.client.rest import ApiException


def ajob(phase="Running", version="5", nodes=1):
    return {"apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
            "metadata": {"name": "llm", "namespace": "team", "uid": "u1",
                         "resourceVersion": version},
            "spec": {"numNodes": nodes, "template": {"spec": {"containers": [
                {"name": "trainer"}]}}},
            "status": {"phase": phase, **({"conditions": [{"type": phase, "status": "True"}]}
                                          if phase == "Succeeded" else {})}}


def pod(index=0, uid="p0", phase="Running"):
    return {"metadata": {"name": f"llm-{index}", "uid": uid, "resourceVersion": "9",
                         "labels": {"accelerate-operator.io/attempt": "0"}},
            "status": {"phase": phase}}


class Stream:
    """A streamed response: watch events (or log lines), then the end; `drop`: the connection
    breaks instead; `hold`: stays open until shut down, as a quiet watch does."""

    status = 200

    def __init__(self, events=(), lines=(), drop=False, hold=False):
        self.chunks = [(json.dumps({"type": kind, "object": body}) + "\n").encode()
                       for kind, body in events] + [(line + "\n").encode() for line in lines]
        self.drop, self.hold, self.shut = drop, hold, threading.Event()

    def stream(self, amt=None, decode_content=False):
        yield from self.chunks
        if self.hold:
            self.shut.wait(30)
            raise urllib3.exceptions.ProtocolError("connection shut down")
        if self.drop:
            raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")

    def shutdown(self):
        self.shut.set()

    def close(self):
        pass

    def release_conn(self):
        pass


def bad_request(message):
    error = ApiException(status=400, reason="Bad Request")
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


class Custom:
    """The job answers the get; each watch call takes the next of `watches` (a Stream, or an
    exception to raise)."""

    def __init__(self, job, watches):
        self.job, self.watches, self.calls = job, list(watches), []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return self.job

    def list_namespaced_custom_object(self, group, version, namespace, plural, **kwargs):
        if not kwargs.get("watch"):
            return {"metadata": {"resourceVersion": self.job["metadata"]["resourceVersion"]},
                    "items": [self.job]}
        self.calls.append(kwargs)
        answer = self.watches.pop(0) if len(self.watches) > 1 else self.watches[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    list_cluster_custom_object = None  # set per test


class Core:
    """The job's pods (listed, then `pod_watch`) and their logs: `logs[pod]` a Stream, or an
    ApiException the log call raises."""

    def __init__(self, pods=(), pod_watch=None, logs=None):
        self.pods, self.pod_watch, self.logs = list(pods), pod_watch or Stream(hold=True), logs
        self.log_calls, self.pod_watches = [], 0

    def list_namespaced_pod(self, namespace, label_selector=None, **kwargs):
        if kwargs.get("watch"):
            self.pod_watches += 1
            return self.pod_watch
        return {"metadata": {"resourceVersion": "8"}, "items": self.pods}

    def list_namespaced_config_map(self, namespace, label_selector=None):
        return kubernetes.client.V1ConfigMapList(items=[])  # no attempt archived

    def read_namespaced_pod_log(self, name, namespace, container=None, follow=False,
                                tail_lines=None, since_seconds=None, **kwargs):
        self.log_calls.append({"follow": follow, "tail_lines": tail_lines})
        answer = self.logs[name]
        if isinstance(answer, Exception):
            raise answer
        return answer if follow else "".join(c.decode() for c in answer.chunks)


def client(custom, core=None) -> AccelerateJobClient:
    c = AccelerateJobClient(namespace="team", api_client=kubernetes.client.ApiClient())
    c.requests.custom, c.requests.core = custom, core or Core()
    return c


@pytest.fixture
def quick_retries(monkeypatch):
    """Backoffs recorded rather than slept; the server counts as unreachable after 0.3 s."""
    slept = []
    monkeypatch.setattr(request, "UNREACHABLE_SECONDS", 0.3)
    monkeypatch.setattr(request.Cancel, "wait", lambda self, seconds: (
        slept.append(seconds), self._event.wait(0.01))[1])
    return slept


# ---- a dropped watch is watched again -----------------------------------------------------


def test_wait_survives_a_dropped_watch_resuming_from_the_last_version(quick_retries):
    done = ajob("Succeeded", version="7")
    custom = Custom(ajob(), [Stream([("MODIFIED", ajob(version="6"))], drop=True),
                             Stream([("MODIFIED", done)])])
    assert client(custom).wait("llm", timeout=30) == done
    assert [call["resource_version"] for call in custom.calls] == ["5", "6"]
    assert quick_retries == [request.RETRY_FIRST_SECONDS]


def test_top_survives_a_dropped_watch(quick_retries):
    custom = Custom(ajob(), [Stream(drop=True), urllib3.exceptions.ProtocolError("reset"),
                             Stream([("MODIFIED", ajob("Succeeded", version="7"))])])
    custom.list_cluster_custom_object = lambda *a, **k: custom.list_namespaced_custom_object(
        *a, None, **k)
    views = client(custom).watch_all()
    assert [[j["status"]["phase"] for j in next(views)] for _ in range(2)] == [
        ["Running"], ["Succeeded"]]
    assert quick_retries == [0.8, 1.6]  # the second failure never got an answer: backing off


def test_a_server_that_stays_unreachable_ends_the_watch_saying_so(quick_retries):
    refused = urllib3.exceptions.MaxRetryError(None, "/apis", ConnectionRefusedError(111))
    custom = Custom(ajob(), [refused])
    with pytest.raises(AccelerateJobError, match="cannot reach the Kubernetes API server"):
        client(custom).wait("llm", timeout=600)
    assert len(custom.calls) > 3
    assert quick_retries[:7] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0]


def test_a_refused_watch_is_not_retried():
    forbidden = ApiException(status=403, reason="Forbidden")
    custom = Custom(ajob(), [forbidden])
    with pytest.raises(AccelerateJobError, match="not allowed to watch AccelerateJob llm"):
        client(custom).wait("llm", timeout=30)
    assert len(custom.calls) == 1


# ---- logs -f leaves nothing behind --------------------------------------------------------


def follower(log=None, **core):
    log = log or Stream(lines=["a", "b"])
    job_watch = Stream([("MODIFIED", ajob("Succeeded", version="6"))])
    base = Core(pods=[pod()], logs={"llm-0": log}, **core)
    return client(Custom(ajob(), [job_watch]), base), base


def test_a_follower_that_ends_stops_its_watches_and_leaves_no_thread():
    before = set(threading.enumerate())
    c, core = follower()
    assert list(c.logs("llm", follow=True)) == ["a", "b"]
    assert core.pod_watch.shut.is_set() or not core.pod_watches  # shut down, if it was open
    assert set(threading.enumerate()) == before


def test_a_follower_the_caller_stops_reading_leaves_no_thread():
    before = set(threading.enumerate())
    c, core = follower(log=Stream(lines=["a"], hold=True))
    lines = c.logs("llm", follow=True)
    assert next(lines) == "a"
    lines.close()
    assert core.logs["llm-0"].shut.is_set()  # the log stream it held open was shut down
    assert set(threading.enumerate()) == before


# ---- what the log call refuses ------------------------------------------------------------


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_wrong_container_is_the_servers_message_not_a_pod_that_has_not_started(fake):
    wrong = bad_request("container foo is not valid for pod llm-0")
    c, _ = follower(log=wrong)
    fake(c)
    assert run("logs", "llm", "-c", "foo") == (
        1, "", "error: cannot read the log of pod llm-0: container foo is not valid for pod "
               "llm-0\n")
    c.requests.core.logs["llm-0"] = bad_request(
        'container "trainer" in pod "llm-0" is waiting to start: ContainerCreating')
    code, _, err = run("logs", "llm")
    assert code == 1 and err.startswith("error: pod llm-0 has not started yet (")


def test_an_error_while_following_goes_to_stderr_with_exit_1(fake):
    c, _ = follower(log=bad_request("container foo is not valid for pod llm-0"))
    fake(c)
    code, out, err = run("logs", "llm", "-f", "-c", "foo")
    assert (code, out) == (1, "")
    assert err == ("error: cannot read the log of pod llm-0: container foo is not valid for "
                   "pod llm-0\n")


def test_follow_takes_the_tail_and_minus_one_is_every_line(fake):
    c, core = follower()
    fake(c)
    assert run("logs", "llm", "-f", "--tail", "5") == (0, "a\nb\n", "")
    assert core.log_calls[-1] == {"follow": True, "tail_lines": 5}
    core.logs["llm-0"] = Stream(lines=["a", "b"])
    assert run("logs", "llm", "--tail=-1") == (0, "a\nb\n", "")
    assert core.log_calls[-1] == {"follow": False, "tail_lines": None}


def test_a_wait_whose_time_runs_out_on_an_unreachable_server_says_unreachable(quick_retries,
                                                                              monkeypatch):
    monkeypatch.setattr(request, "UNREACHABLE_SECONDS", 600)
    refused = urllib3.exceptions.MaxRetryError(None, "/apis", ConnectionRefusedError(111))
    with pytest.raises(AccelerateJobError, match="cannot reach the Kubernetes API server"):
        client(Custom(ajob(), [refused])).wait("llm", timeout=0.2)
