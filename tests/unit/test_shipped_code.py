"""Shipping the user's code: `submit` packs the script or a working directory (ignore rules,
deterministic bytes, a size limit checked before anything is created), the client creates the
code's ConfigMap owned by the job, the operator mounts it with a writable workspace, and the
trainer checks, unpacks and installs requirements before launch. No cluster."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import site
import tarfile
from pathlib import Path

import kubernetes
import pytest
import yaml
from accelerate_job import AccelerateJobClient, AccelerateJobError, cli, session
from accelerate_job.code import (
    CodeError,
    CodeTooLarge,
    build_tarball,
    is_ignored,
    pack_code,
    parse_ignore,
)
from accelerate_operator.api import parse_job
from accelerate_operator.resources.pods import build_pod
from accelerate_trainer import workspace as trainer_workspace
from accelerate_trainer.workspace import (
    CodeError as TrainerCodeError,
)
from accelerate_trainer.workspace import (
    RequirementsError,
    ShippedCode,
    build_pip_argv,
    install_requirements,
    parse_shipped_code,
    unpack_code,
    workspace_env,
)
from kubernetes.client.rest import ApiException

from tests.helpers.jobs import JobBuilder

CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
use_cpu: true
mixed_precision: "no"
"""
SHA = "ab" * 32


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A laptop's project: a script, a helper module, a package, and what must not travel."""
    root = tmp_path / "project"
    (root / "lib").mkdir(parents=True)
    (root / "train.py").write_text("import helpers\nhelpers.run()\n")
    (root / "helpers.py").write_text("def run():\n    print('ok')\n")
    (root / "lib" / "__init__.py").write_text("")
    (root / "lib" / "model.py").write_text("SIZE = 2\n")
    (root / "requirements.txt").write_text("six\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for junk in (".git/HEAD", "__pycache__/helpers.cpython-311.pyc", ".venv/bin/python",
                 "data/big.bin", "outputs/ckpt/model.pt", "notes.tmp", "keep/notes.tmp"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("x")
    (root / ".gitignore").write_text("# local\n/data/\n*.tmp\n!keep/notes.tmp\n")
    (root / ".accelerateignore").write_text("outputs/\n")
    return root


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


# ---- packing ------------------------------------------------------------------------------------


def test_a_workdir_is_packed_without_what_the_ignore_files_and_defaults_exclude(project):
    code = pack_code(str(project / "train.py"), workdir=str(project),
                     requirements=str(project / "requirements.txt"))
    assert code.files == (".accelerateignore", ".gitignore", "helpers.py", "keep/notes.tmp",
                          "lib/__init__.py", "lib/model.py", "requirements.txt", "run.sh",
                          "train.py")
    assert (code.entrypoint, code.requirements) == ("train.py", "requirements.txt")
    found = members(code.data)
    assert list(found) == list(code.files)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in found.values()} == {
        (0, 0, 0, "", "")}
    assert (found["run.sh"].mode, found["train.py"].mode) == (0o755, 0o644)
    assert code.sha256 == hashlib.sha256(code.data).hexdigest()


def test_the_same_tree_packs_to_the_same_bytes(project):
    first = pack_code("train.py", workdir=str(project))
    os.utime(project / "helpers.py", (1, 1))
    assert pack_code(str(project / "train.py"), workdir=str(project)).data == first.data
    assert gzip.decompress(first.data)  # a plain gzip stream, no name or time in its header
    assert first.data[4:8] == b"\0\0\0\0"


def test_a_lone_script_travels_under_its_own_name(project):
    code = pack_code(str(project / "lib" / "model.py"))
    assert (code.files, code.entrypoint, code.requirements) == (("model.py",), "model.py", None)


def test_requirements_outside_the_workdir_are_added_at_the_top(project, tmp_path):
    other = tmp_path / "reqs.txt"
    other.write_text("six\n")
    code = pack_code(str(project / "train.py"), workdir=str(project), requirements=str(other))
    assert code.requirements == "reqs.txt" and "reqs.txt" in code.files
    only = pack_code(None, requirements=str(other))  # --in-image with requirements
    assert (only.files, only.entrypoint) == (("reqs.txt",), None)
    clash = tmp_path / "x" / "helpers.py"
    clash.parent.mkdir()
    clash.write_text("other\n")
    with pytest.raises(CodeError, match="already has a different helpers.py; rename one"):
        pack_code(str(project / "train.py"), workdir=str(project), requirements=str(clash))


def test_a_script_that_is_not_here_points_at_in_image(tmp_path):
    with pytest.raises(CodeError, match="put --in-image before it"):
        pack_code("/opt/accelerate/examples/train.py")


def test_a_script_outside_or_excluded_from_the_workdir_is_refused(project, tmp_path):
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    with pytest.raises(CodeError, match="is not inside --workdir"):
        pack_code(str(outside), workdir=str(project))
    with pytest.raises(CodeError, match=r"excluded by the ignore rules .* !notes.tmp"):
        pack_code(str(project / "notes.tmp"), workdir=str(project))


@pytest.mark.parametrize(("pattern", "path", "is_dir", "ignored"), [
    ("*.log", "a/b/x.log", False, True),
    ("/build", "build", True, True),
    ("/build", "src/build", True, False),
    ("docs/*.md", "docs/a.md", False, True),
    ("docs/*.md", "docs/sub/a.md", False, False),
    ("cache/", "cache", False, False),
    ("cache/", "x/cache", True, True),
    ("**/tmp", "a/b/tmp", True, True),
    ("a/**/z", "a/z", False, True),
    ("a/**/z", "a/b/c/z", False, True),
    ("out/**", "out/x/y", False, True),
    ("file[0-9].txt", "file7.txt", False, True),
    ("file[!0-9].txt", "file7.txt", False, False),
    ("\\#hash", "#hash", False, True),
])
def test_gitignore_patterns(pattern, path, is_dir, ignored):
    assert is_ignored(path, is_dir, parse_ignore([pattern])) is ignored


def test_code_past_what_a_configmap_holds_is_refused_before_anything_is_created(
        project, monkeypatch):
    (project / "weights.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    with pytest.raises(CodeTooLarge) as refused:
        pack_code(str(project / "train.py"), workdir=str(project))
    message = str(refused.value)
    assert "more than the 960 KiB a job can carry" in message
    assert "is 2.0 MiB compressed" in message and "weights.bin (2.0 MiB)" in message
    assert "nothing was created" in message
    assert "--in-image PATH" in message and "volume" in message

    def no_cluster(args):
        raise AssertionError("a cluster was contacted")
    monkeypatch.setattr(session, "client", no_cluster)
    config = project / "accelerate.yaml"
    config.write_text(CPU_CONFIG)
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["submit", "--config", str(config), "--image", "i", "--workdir",
                     str(project), str(project / "train.py")], out=out, err=err)
    assert code == 1 and out.getvalue() == ""
    assert err.getvalue().startswith(f"error: --workdir {project} (11 files) is ")


# ---- submit: the objects --------------------------------------------------------------------


def test_submit_dry_run_prints_the_job_with_its_code_and_the_code_configmap(project,
                                                                           monkeypatch):
    monkeypatch.chdir(project)
    (project / "accelerate.yaml").write_text(CPU_CONFIG)
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["submit", "--config", "accelerate.yaml", "--image", "trainer:cpu",
                     "--name", "mine", "-n", "team", "--workdir", ".", "--requirements",
                     "requirements.txt", "--dry-run", "-o", "yaml", "lib/model.py", "--lr", "1"],
                    out=out, err=err)
    assert (code, err.getvalue()) == (0, "")
    configmap, job, shipped = yaml.safe_load_all(out.getvalue())
    packed = pack_code("lib/model.py", workdir=".", requirements="requirements.txt")
    assert configmap["metadata"]["name"] == "mine-accelerate-yaml"
    assert job["spec"]["code"] == {"configMap": "mine-code", "sha256": packed.sha256,
                                   "requirements": "requirements.txt"}
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "lib/model.py", "--lr", "1"]
    assert shipped == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        # No job-name label: the operator's watches never carry the code.
        "metadata": {"name": "mine-code", "namespace": "team", "labels": {
            "app.kubernetes.io/name": "accelerate-job",
            "app.kubernetes.io/instance": "mine",
            "app.kubernetes.io/managed-by": "accelerate-operator",
            "app.kubernetes.io/component": "code"}},
        "binaryData": {"code.tar.gz": base64.b64encode(packed.data).decode()},
        "immutable": True,
    }


def test_in_image_ships_nothing_and_refuses_a_workdir(project, capsys):
    config = project / "accelerate.yaml"
    config.write_text(CPU_CONFIG)
    out = io.StringIO()
    assert cli.main(["submit", "--config", str(config), "--image", "i", "--name", "j", "-n",
                     "x", "--dry-run", "-o", "json", "--in-image", "/opt/t.py", "--steps", "2"],
                    out=out, err=io.StringIO()) == 0
    configmap, job = json.loads(out.getvalue())["items"]
    assert "code" not in job["spec"]
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["/opt/t.py", "--steps",
                                                                        "2"]
    err = io.StringIO()
    assert cli.main(["submit", "--config", str(config), "--image", "i", "--dry-run",
                     "--workdir", str(project), "--in-image", "/opt/t.py"],
                    out=io.StringIO(), err=err) == 1
    assert "drop one of them" in err.getvalue()


# ---- the client: the code's ConfigMap is born owned by the job ------------------------------


class Recorder:
    """CoreV1Api and CustomObjectsApi fakes that record every call in order."""

    def __init__(self, fail_code_with: int | None = None):
        self.calls: list[tuple] = []
        self.fail_code_with = fail_code_with
        self.created: dict[str, dict] = {}

    # custom objects
    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        raise ApiException(status=404, reason="Not Found")

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kw):
        self.calls.append(("create", "AccelerateJob", body["metadata"]["name"]))
        return {**body, "metadata": {**body["metadata"], "uid": "uid-1"}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.calls.append(("delete", "AccelerateJob", name))

    # core
    def create_namespaced_config_map(self, namespace, body, dry_run=None):
        name = body["metadata"]["name"]
        self.calls.append(("create", "ConfigMap", name))
        if name.endswith("-code") and self.fail_code_with:
            raise ApiException(status=self.fail_code_with, reason="Forbidden")
        self.created[name] = body
        return body

    def patch_namespaced_config_map(self, name, namespace, body):
        self.calls.append(("patch", "ConfigMap", name))


def fake_client(recorder: Recorder) -> AccelerateJobClient:
    client = AccelerateJobClient(namespace="team", api_client=kubernetes.client.ApiClient())
    client.requests.custom = client.requests.core = recorder
    return client


def test_the_client_creates_the_code_configmap_owned_by_the_created_job(project):
    code = pack_code(str(project / "train.py"), workdir=str(project))
    job = JobBuilder("mine", "team").build()
    recorder = Recorder()
    fake_client(recorder).submit(job, config_yaml=CPU_CONFIG, code=code)
    assert recorder.calls == [
        ("get", "mine"),
        ("create", "ConfigMap", "mine-accelerate-yaml"),
        ("create", "AccelerateJob", "mine"),
        ("patch", "ConfigMap", "mine-accelerate-yaml"),
        ("create", "ConfigMap", "mine-code"),
    ]
    shipped = recorder.created["mine-code"]
    assert shipped["metadata"]["ownerReferences"] == [{
        "apiVersion": "accelerate-operator.io/v1alpha1", "kind": "AccelerateJob",
        "name": "mine", "uid": "uid-1"}]
    assert base64.b64decode(shipped["binaryData"]["code.tar.gz"]) == code.data


def test_a_job_whose_code_cannot_be_shipped_is_deleted_again(project):
    code = pack_code(str(project / "train.py"), workdir=str(project))
    recorder = Recorder(fail_code_with=403)
    with pytest.raises(AccelerateJobError, match="the job was deleted again"):
        fake_client(recorder).submit(JobBuilder("mine", "team").build(), code=code)
    assert recorder.calls[-2:] == [("create", "ConfigMap", "mine-code"),
                                   ("delete", "AccelerateJob", "mine")]


# ---- the operator: the pod mounts the code and gets a workspace -----------------------------


def test_a_pod_of_a_job_with_code_mounts_it_read_only_with_a_writable_workspace():
    body = JobBuilder().build()
    body["spec"]["code"] = {"configMap": "train-code", "sha256": SHA,
                            "requirements": "requirements.txt"}
    body["spec"]["runPolicy"]["restartInPlace"] = False  # no report channel on pod 1
    pod = build_pod(parse_job(body), 1, attempt=0)
    trainer = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert {k: v for k, v in env.items() if k.startswith("ACCELERATE_CODE_")} == {
        "ACCELERATE_CODE_ARCHIVE": "/etc/accelerate-code/code.tar.gz",
        "ACCELERATE_CODE_SHA256": SHA,
        "ACCELERATE_CODE_WORKSPACE": "/workspace",
        "ACCELERATE_CODE_REQUIREMENTS": "requirements.txt",
    }
    assert trainer["volumeMounts"] == [
        {"name": "accelerate-config", "mountPath": "/etc/accelerate", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "accelerate-code", "mountPath": "/etc/accelerate-code", "readOnly": True},
        {"name": "accelerate-workspace", "mountPath": "/workspace"},
    ]
    assert pod["spec"]["volumes"] == [
        {"name": "accelerate-config", "configMap": {"name": "train-accelerate-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "accelerate-code", "configMap": {"name": "train-code"}},
        {"name": "accelerate-workspace", "emptyDir": {}},
    ]


def test_a_workspace_the_template_mounts_is_used_as_it_is():
    body = (JobBuilder().pod_spec(volumes=[{"name": "workspace", "emptyDir": {}}])
            .container(volumeMounts=[{"name": "workspace", "mountPath": "/workspace"}]).build())
    body["spec"]["code"] = {"configMap": "train-code", "sha256": SHA}
    pod = build_pod(parse_job(body), 0, attempt=0)
    names = [v["name"] for v in pod["spec"]["volumes"]]
    assert names == ["workspace", "accelerate-config", "dshm", "accelerate-code",
                     "accelerate-report"]
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "ACCELERATE_CODE_REQUIREMENTS" not in env


def test_a_job_without_code_gets_no_code_volume_or_env():
    pod = build_pod(parse_job(JobBuilder().build()), 0, attempt=0)
    assert not [v for v in pod["spec"]["volumes"] if "code" in v["name"]]
    assert not [e for e in pod["spec"]["containers"][0]["env"]
                if e["name"].startswith("ACCELERATE_CODE_")]


# ---- the trainer: check, unpack, install ----------------------------------------------------


def shipped(tmp_path: Path, data: bytes, sha: str | None = None, **kw) -> ShippedCode:
    archive = tmp_path / "mount" / "code.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    archive.write_bytes(data)
    return ShippedCode(archive=str(archive), sha256=sha or hashlib.sha256(data).hexdigest(),
                       workspace=str(tmp_path / "workspace"), **kw)


def test_the_trainer_unpacks_what_submit_packed(project, tmp_path):
    code = pack_code(str(project / "train.py"), workdir=str(project))
    target = shipped(tmp_path, code.data)
    assert unpack_code(target) == list(code.files)
    workspace = Path(target.workspace)
    assert (workspace / "lib" / "model.py").read_text() == "SIZE = 2\n"
    assert os.access(workspace / "run.sh", os.X_OK)


def test_changed_or_missing_code_is_refused_before_anything_is_written(project, tmp_path):
    code = pack_code(str(project / "train.py"), workdir=str(project))
    with pytest.raises(TrainerCodeError, match="was changed after submit"):
        unpack_code(shipped(tmp_path, code.data, sha=SHA))
    assert not (tmp_path / "workspace").exists()
    with pytest.raises(TrainerCodeError, match="cannot read the shipped code"):
        unpack_code(ShippedCode(archive=str(tmp_path / "none"), sha256=SHA,
                                workspace=str(tmp_path / "workspace")))


@pytest.mark.parametrize("name", ["../escape.py", "/etc/passwd", "a/../../b"])
def test_a_member_outside_the_workspace_is_refused(tmp_path, name):
    with pytest.raises(TrainerCodeError, match="a path outside the workspace"):
        unpack_code(shipped(tmp_path, build_tarball({name: b"x"})))
    assert not (tmp_path / "workspace").exists()


def test_the_shipped_code_is_read_from_the_env_the_operator_sets():
    assert parse_shipped_code({}) is None
    assert parse_shipped_code({"ACCELERATE_CODE_SHA256": SHA,
                               "ACCELERATE_CODE_REQUIREMENTS": "r.txt"}) == ShippedCode(
        archive="/etc/accelerate-code/code.tar.gz", sha256=SHA, workspace="/workspace",
        requirements="r.txt")


def test_requirements_go_to_a_virtualenv_that_sees_the_images_packages(tmp_path, monkeypatch):
    """pip runs in a virtualenv of the workspace whose .pth lists the image's site-packages: the
    image's packages count as installed, and a changed version goes beside them (pip never
    uninstalls from the read-only image, as `--prefix` would)."""
    assert build_pip_argv("/w/r.txt", "/w/.accelerate-venv/bin/python") == [
        "/w/.accelerate-venv/bin/python", "-m", "pip", "install", "--no-input", "-r", "/w/r.txt"]
    target = shipped(tmp_path, build_tarball({"r.txt": b"six\n"}), requirements="r.txt")
    unpack_code(target)
    ran = []
    monkeypatch.setattr(trainer_workspace.subprocess, "call",
                        lambda argv, env, cwd: ran.append((argv, env["TMPDIR"])) or 0)
    packages = install_requirements(target, {})
    venv = Path(target.workspace) / ".accelerate-venv"
    assert ran == [([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", "-r",
                     str(Path(target.workspace) / "r.txt")], f"{target.workspace}/.tmp")]
    assert packages == [str(next(venv.glob("lib/python*/site-packages")))]
    pth = (Path(packages[0]) / "_accelerate_image.pth").read_text().splitlines()
    assert pth == site.getsitepackages()
    assert workspace_env(target, packages, {"PYTHONPATH": "/x", "PATH": "/bin"}) == {
        "PYTHONPATH": os.pathsep.join([packages[0], target.workspace, "/x"]),
        "PATH": os.pathsep.join([str(venv / "bin"), "/bin"])}


def test_a_failed_requirements_install_says_where_its_output_is(tmp_path, monkeypatch):
    target = shipped(tmp_path, build_tarball({"r.txt": b"nope==0\n"}), requirements="r.txt")
    unpack_code(target)
    monkeypatch.setattr(trainer_workspace.subprocess, "call", lambda argv, env, cwd: 1)
    with pytest.raises(RequirementsError, match=r"failed with exit code 1 \(its output is in "
                                                "this pod's log\\)"):
        install_requirements(target, {})


# ---- the trainer's entrypoint with shipped code ---------------------------------------------

CONFIGS = Path(__file__).parent / "accelerate_configs"


@pytest.fixture
def trainer_main(tmp_path, monkeypatch, termination_log):
    import accelerate_trainer.__main__ as main_module

    monkeypatch.chdir(tmp_path)  # restored after the test: main() changes into the workspace
    monkeypatch.setattr(main_module, "wait_for_master", lambda topology, timeout: None)
    execs = []
    monkeypatch.setattr(main_module.os, "execvpe", lambda *args: execs.append(args))
    main_module.execs = execs
    return main_module


def code_env(target: ShippedCode) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0",
            "NUM_NODES": "2", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4",
            "ACCELERATE_CONFIG_FILE": str(CONFIGS / "multi_cpu.yaml"),
            "ACCELERATE_CODE_ARCHIVE": target.archive, "ACCELERATE_CODE_SHA256": target.sha256,
            "ACCELERATE_CODE_WORKSPACE": target.workspace,
            **({"ACCELERATE_CODE_REQUIREMENTS": target.requirements}
               if target.requirements else {})}


def test_main_unpacks_the_code_then_launches_the_script_from_the_workspace(
        project, tmp_path, trainer_main, caplog):
    caplog.set_level("INFO")
    code = pack_code(str(project / "train.py"), workdir=str(project))
    target = shipped(tmp_path, code.data)
    trainer_main.main(["train.py", "--lr", "1"], code_env(target))
    (argv0, argv, env), = trainer_main.execs
    assert argv[-3:] == ("train.py", "--lr", "1")
    assert Path.cwd() == Path(target.workspace)
    assert (Path(target.workspace) / "helpers.py").is_file()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == target.workspace
    # The versions it runs with, logged once (pod 0's supervisor reports them to the operator).
    info = [record.getMessage() for record in caplog.records
            if record.getMessage().startswith("versions (")]
    assert len(info) == 1
    assert info[0].startswith("versions (image): python ") and ", accelerate " in info[0]


def test_main_exits_78_on_code_changed_after_submit(project, tmp_path, trainer_main):
    code = pack_code(str(project / "train.py"), workdir=str(project))
    assert trainer_main.main(["train.py"], code_env(shipped(tmp_path, code.data, sha=SHA))) == 78
    assert (tmp_path / "termination-log").read_text().startswith("shipped code: ")
    assert trainer_main.execs == []


def test_main_exits_75_when_the_requirements_do_not_install(tmp_path, trainer_main,
                                                            monkeypatch):
    target = shipped(tmp_path, build_tarball({"train.py": b"", "r.txt": b"nope==0\n"}),
                     requirements="r.txt")
    monkeypatch.setattr(trainer_workspace.subprocess, "call", lambda argv, env, cwd: 1)
    assert trainer_main.main(["train.py"], code_env(target)) == 75
    assert "requirements: pip install -r r.txt failed" in (
        tmp_path / "termination-log").read_text()
    assert trainer_main.execs == []
