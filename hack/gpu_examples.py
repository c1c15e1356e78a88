"""Run the accelerate config of every GPU example for real on this machine's GPUs.

CI has no GPU, so there FSDP and DeepSpeed are checked as plumbing only. On a GPU machine this
script does the rest. For each examples/gpu-*.yaml it renders the job for one node x all visible
GPUs with the operator's own builders (ConfigMap content, pod env), then runs `accelerate-trainer
examples/train.py` exactly as a pod would: validation, `accelerate launch`, then real bf16 training
with FSDP, DeepSpeed ZeRO-2 and ZeRO-3 with CPU offload. It uses the tiny model from a config
(no download); the FSDP example wraps Qwen2 layers, so the tiny Llama's layer is wrapped
instead. Prints one line per example: steps, first and last loss, wall time and whether every
rank ended with the same weights.

    python3 hack/gpu_examples.py [--max-steps 30]   (from the repository root; needs torch, CUDA)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "trainer")]

import torch  # noqa: E402
import yaml  # noqa: E402
from accelerate_operator.api import parse_job  # noqa: E402
from accelerate_operator.resources.configmap import render_accelerate_config  # noqa: E402
from accelerate_operator.resources.pods import build_pod  # noqa: E402

from devtools.examples import EXAMPLES_DIR, load_example, user_config  # noqa: E402

TINY_MODEL_LAYER = "LlamaDecoderLayer"


def run_example(path: Path, gpus: int, max_steps: int, workdir: Path) -> dict:
    body, configmaps = load_example(path)
    body["spec"]["numNodes"] = 1
    body["spec"]["numProcPerNode"] = gpus
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": gpus}}
    job = parse_job(body)
    # The example is reshaped to one node, so the topology keys its YAML pins for 2 nodes go.
    written = {k: v for k, v in user_config(body, configmaps).items()
               if k not in ("num_machines", "num_processes")}
    config = render_accelerate_config(job, written)
    if "fsdp_config" in config:
        config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = TINY_MODEL_LAYER
    accumulation = (config.get("deepspeed_config") or {}).get("gradient_accumulation_steps", 2)
    config_file = Path(tempfile.mkdtemp(prefix="accelerate-config-")) / "config.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    container = build_pod(job, 0, attempt=0)["spec"]["containers"][0]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    env.update(MASTER_ADDR="127.0.0.1", ACCELERATE_CONFIG_FILE=str(config_file),
               PYTHONPATH=os.pathsep.join([str(ROOT / "trainer"), env.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    argv = [sys.executable, "-m", "accelerate_trainer", str(ROOT / "examples" / "train.py"),
            f"--max-steps={max_steps}", f"--gradient-accumulation-steps={accumulation}",
            "--log-every=5", "--learning-rate=3e-3"]
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    (workdir / f"{path.stem}.log").write_text(out)
    done = re.search(r"TRAINING_DONE steps=(\d+) first_loss=(\S+) last_loss=(\S+)", out)
    checksums = set(re.findall(r"FINAL rank=\d+ param_checksum=(\S+)", out))
    return {
        "example": path.name,
        "type": config.get("distributed_type"),
        "precision": config.get("mixed_precision"),
        "exit": proc.returncode,
        "steps": int(done.group(1)) if done else None,
        "first_loss": float(done.group(2)) if done else None,
        "last_loss": float(done.group(3)) if done else None,
        "same_weights": len(checksums) == 1 if checksums else None,
        "seconds": round(elapsed, 1),
        "tail": "" if proc.returncode == 0 else out[-3000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--logs", default=None, help="keep each run's log in this directory")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no GPU visible: this script is for GPU machines", file=sys.stderr)
        return 2
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    workdir = Path(args.logs or tempfile.mkdtemp(prefix="gpu-examples-"))
    workdir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in sorted(EXAMPLES_DIR.glob("gpu-*.yaml")):
        result = run_example(path, gpus, args.max_steps, workdir)
        ok = result["exit"] == 0 and result["steps"] == args.max_steps and (
            result["last_loss"] < result["first_loss"])
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {result['example']:36} {result['type']:10} "
              f"{result['precision']:5} steps={result['steps']} loss {result['first_loss']} -> "
              f"{result['last_loss']} same_weights={result['same_weights']} "
              f"{result['seconds']}s", flush=True)
        if result["tail"]:
            print(result["tail"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
