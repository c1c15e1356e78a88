"""Capture real failed launches for tests/unit/launch_failures/: run `accelerate launch` on CPU
(gloo, 2 processes) with the trainer's launch hook, once per way a launch fails, and keep what
the hook wrote (launch-report.json, the ranks' torchelastic error files inside it) and the
launch's stderr. Run again after a torch or accelerate upgrade:
`python -m devtools.capture_launch_failures tests/unit/launch_failures`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from accelerate_trainer.error_files import ENV_LAUNCH_REPORT, launch_env

CONFIG = "distributed_type: MULTI_GPU\nuse_cpu: true\n"
PROLOGUE = "import os, sys, time, signal, datetime\nimport torch.distributed as dist\n"
INIT = ("dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=3))\n"
        "rank = dist.get_rank()\n")
# case -> (script text or None for a path that does not exist, extra launch flags)
CASES = {
    "exception_in_rank_1": (PROLOGUE + INIT + "def step(batch):\n"
                            "    raise ValueError(f'bad batch {batch} on rank {rank}')\n"
                            "if rank == 1:\n    step(7)\ndist.barrier()\n", []),
    "script_path_typo": (None, []),
    "import_error": ("import os\nimport transformerz\n", []),
    "gloo_timeout": (PROLOGUE + INIT + "if rank == 1:\n    time.sleep(60)\n"
                     "dist.all_reduce(__import__('torch').ones(1))\n", []),
    "sigkill_rank_1": (PROLOGUE + INIT + "if rank == 1:\n"
                       "    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()\n", []),
    # machine 0 of 2 whose machine 1 never comes: static and c10d rendezvous
    "rendezvous_timeout_static": (PROLOGUE + "print('never runs')\n",
                                  ["--num_machines", "2", "--machine_rank", "0",
                                   "--main_process_ip", "127.0.0.1"]),
    # machine 1 of 2 whose machine 0 is not there
    "rendezvous_timeout_static_worker": (PROLOGUE + "print('never runs')\n",
                                         ["--num_machines", "2", "--machine_rank", "1",
                                          "--main_process_ip", "127.0.0.1"]),
    "rendezvous_timeout_c10d": (PROLOGUE + "print('never runs')\n",
                                ["--num_machines", "2", "--machine_rank", "0",
                                 "--main_process_ip", "127.0.0.1", "--rdzv_backend", "c10d"]),
}


def capture(name: str, script: str | None, flags: list[str], out: Path, work: Path) -> None:
    path = work / f"{name}.py"
    if script is None:
        path = work / "trian.py"  # the typo: train.py exists, trian.py does not
        (work / "train.py").write_text("print('trained')\n")
    else:
        path.write_text(script)
    report = work / f"{name}-report.json"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", ENV_LAUNCH_REPORT: str(report),
           "OMP_NUM_THREADS": "1", **launch_env(os.environ)}
    argv = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
            "--config_file", str(work / "config.yaml"), "--num_processes", "2",
            "--main_process_port", "29611", "--multi_gpu", "--monitor_interval", "0.1",
            "--rdzv_conf", "timeout=5,join_timeout=5", *flags, str(path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, cwd=work)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    (target / "stderr.txt").write_text(done.stderr.replace(str(work), "/work"))
    (target / "exit-code").write_text(f"{done.returncode}\n")
    data = json.loads(report.read_text()) if report.exists() else None
    text = json.dumps(data, indent=1).replace(str(work), "/work") if data else "null"
    (target / "launch-report.json").write_text(text + "\n")
    print(f"{name}: exit {done.returncode}, report {'yes' if data else 'no'}")


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "tests/unit/launch_failures")
    with tempfile.TemporaryDirectory(prefix="launch-failures-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(CONFIG)
        for name, (script, flags) in CASES.items():
            if len(argv) < 2 or name in argv[1:]:
                capture(name, script, flags, out, work)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
