"""The launch hook in real Python processes: what a rank writes into torchelastic's error file is
what torch's own ProcessFailure reads, a script Python cannot open is recorded with Python's own
line, and an image's own sitecustomize still runs after the hook's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from accelerate_trainer import error_files

TRAINER = os.path.dirname(os.path.dirname(error_files.__file__))


def run(tmp_path, argv, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",
                                                             error_files.ENV_ERROR_FILE)}
    base["PYTHONPATH"] = TRAINER
    environ = {**base, **error_files.launch_env(base), **env}
    return subprocess.run([sys.executable, *argv], env=environ, capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)


def test_a_rank_that_raises_writes_the_error_file_torch_reads(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def step():\n    raise KeyError('labels')\nstep()\n")
    error_file = tmp_path / "error.json"
    done = run(tmp_path, [str(script)], TORCHELASTIC_ERROR_FILE=str(error_file))
    assert done.returncode == 1 and "KeyError: 'labels'" in done.stderr  # Python's own print
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "KeyError: 'labels'"
    assert "raise KeyError('labels')" in failure.message["extraInfo"]["py_callstack"]
    assert abs(failure.timestamp - json.loads(error_file.read_text())["message"]["extraInfo"][
        "time"]) < 1


def test_a_script_python_cannot_open_is_recorded_in_pythons_own_words(tmp_path):
    error_file = tmp_path / "error.json"
    done = run(tmp_path, [str(tmp_path / "trian.py")], TORCHELASTIC_ERROR_FILE=str(error_file))
    assert done.returncode == 2
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded == done.stderr.strip()  # the line Python itself printed


def test_a_launcher_that_fails_records_its_exception_class_names(tmp_path):
    report = tmp_path / "report.json"
    done = run(tmp_path, ["-c", "raise TimeoutError('no peers')"],
               **{error_files.ENV_LAUNCH_REPORT: str(report)})
    assert done.returncode == 1
    data = json.loads(report.read_text())
    assert data["exception"][:2] == ["TimeoutError", "OSError"]
    assert data["message"] == "no peers" and "failures" not in data


def test_a_process_that_succeeds_writes_nothing(tmp_path):
    error_file, report = tmp_path / "error.json", tmp_path / "report.json"
    done = run(tmp_path, ["-c", "print('ok')"], TORCHELASTIC_ERROR_FILE=str(error_file))
    assert done.returncode == 0 and not error_file.exists()
    done = run(tmp_path, ["-c", "print('ok')"], **{error_files.ENV_LAUNCH_REPORT: str(report)})
    assert done.returncode == 0 and not report.exists()


def test_the_images_own_sitecustomize_still_runs(tmp_path):
    image = tmp_path / "image-site"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import os\nos.environ['IMAGE_SITE'] = 'ran'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([TRAINER, error_files.HOOK_DIR, str(image)])
    done = subprocess.run([sys.executable, "-c", "import os, sys; print(os.environ.get("
                           "'IMAGE_SITE'), sys.excepthook.__module__)"],
                          env={**env, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "e.json")},
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["ran", error_files.__name__]


def test_the_hook_goes_after_the_users_own_folders():
    env = error_files.launch_env({"PYTHONPATH": "/workspace"})
    assert env["PYTHONPATH"].split(os.pathsep) == ["/workspace", error_files.HOOK_DIR]
    assert error_files.launch_env({})["PYTHONPATH"] == error_files.HOOK_DIR


PROBE_THEN = """\
import os, subprocess, sys
probe = [sys.executable, "-c", "import flash_attn_optional_probe"]
inherited = subprocess.run(probe, capture_output=True)
copied = subprocess.run(probe, capture_output=True, env=dict(os.environ))
print(inherited.returncode, copied.returncode, os.environ["TORCHELASTIC_ERROR_FILE"])
{end}
"""


def test_a_helper_the_rank_starts_does_not_write_the_ranks_error_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROBE_THEN.format(end="sys.exit(3)"))
    error_file = tmp_path / "error.json"
    done = run(tmp_path, [str(script)], TORCHELASTIC_ERROR_FILE=str(error_file))
    # Both probes failed (with or without a copied env), the script still sees torch's
    # variable, and the rank, which exited 3 without an exception, has no error file.
    assert done.stdout.split() == ["1", "1", str(error_file)], done.stderr
    assert done.returncode == 3 and not error_file.exists()


def test_the_rank_still_records_its_own_exception_after_a_failed_helper(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROBE_THEN.format(end="raise KeyError('labels')"))
    error_file = tmp_path / "error.json"
    done = run(tmp_path, [str(script)], TORCHELASTIC_ERROR_FILE=str(error_file))
    assert done.returncode == 1
    assert json.loads(error_file.read_text())["message"]["message"] == "KeyError: 'labels'"


def test_a_rank_of_a_torchrun_inside_a_rank_records_its_own_file():
    outer = "123 /tmp/outer/error.json"
    assert error_files.owns_error_file("/tmp/inner/error.json", outer, pid=456)
    assert not error_files.owns_error_file("/tmp/outer/error.json", outer, pid=456)
    assert error_files.owns_error_file("/tmp/outer/error.json", outer, pid=123)  # exec'd
    assert error_files.owns_error_file("/tmp/outer/error.json", None, pid=456)


def test_an_error_file_is_written_whole_or_not_at_all(tmp_path):
    """A rank stopped while writing left part of its file, and torchrun's JSON read of it
    ended the launcher without the failures it had: a write cut short leaves no file."""
    path = tmp_path / "error.json"
    cut = {"message": {"message": "RuntimeError: Connection closed by peer",
                       "extraInfo": {"cut here": object()}}}  # json.dump fails midway
    error_files.write_json(str(path), cut)
    assert not path.exists() and list(tmp_path.iterdir()) == []
    whole = {"message": {"message": "KeyError: 'input_ids'"}}
    error_files.write_json(str(path), whole)
    assert json.loads(path.read_text()) == whole and list(tmp_path.iterdir()) == [path]
