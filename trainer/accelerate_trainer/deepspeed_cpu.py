"""DeepSpeed on pods without GPUs: the explicit opt-in, and the check each rank makes of what
accelerate really set up.

DeepSpeed ZeRO 1-3 shards for real on CPU over gloo (docs/deepspeed-on-cpu.md), which lets a
user rehearse a DeepSpeed job on a CPU cluster before paying for GPUs. Two ways it goes wrong in
silence, which this module turns into errors:

- without `InitProcessGroupKwargs(backend="gloo")` in the script, accelerate picks no backend for
  DeepSpeed on a CPU (state.py `_prepare_backend`), so every rank believes it is alone (one
  process; `distributed_type` still DEEPSPEED): unsynchronised ranks;
- with `use_cpu` / `ACCELERATE_USE_CPU`, a DeepSpeed config trains plain DDP (MULTI_CPU).

So the trainer lets a DEEPSPEED config launch on a pod whose torch sees no GPU only when the
container sets ENV_DEEPSPEED_ON_CPU, and it tells every rank what it must find
(ENV_EXPECTED_DISTRIBUTED_TYPE, ENV_EXPECTED_WORLD_SIZE); `check_accelerator` compares. Pure but
for reading the env; imports neither accelerate nor torch (the accelerator is passed in, or found
among the modules the script already imported: `check_finished_rank`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

# Set on the trainer container (spec.template ... env) to run a DEEPSPEED config on CPU pods.
ENV_DEEPSPEED_ON_CPU = "ACCELERATE_TRAINER_DEEPSPEED_ON_CPU"
# Set by the trainer for the ranks of every DEEPSPEED launch: what the script's Accelerator must be.
ENV_EXPECTED_DISTRIBUTED_TYPE = "ACCELERATE_TRAINER_EXPECTED_DISTRIBUTED_TYPE"
ENV_EXPECTED_WORLD_SIZE = "ACCELERATE_TRAINER_EXPECTED_WORLD_SIZE"
DOCS = "docs/deepspeed-on-cpu.md"
GLOO_LINE = 'Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])'
TRUE_WORDS = ("1", "true", "yes", "on")


class DistributedMismatch(RuntimeError):
    """The script's Accelerator is not the distributed setup the job launched."""


def deepspeed_on_cpu_requested(environ: Mapping[str, str]) -> bool:
    """True when the container opts in; any other value than the true words is a no."""
    return environ.get(ENV_DEEPSPEED_ON_CPU, "").strip().lower() in TRUE_WORDS


def refusal_message() -> str:
    """Why a DEEPSPEED config on a pod without GPUs is refused, and the two-line fix."""
    return (
        "distributed_type DEEPSPEED needs GPUs but this pod sees none. To rehearse DeepSpeed on "
        f"CPU pods, set the env {ENV_DEEPSPEED_ON_CPU}=1 on the trainer container and build "
        f"the script's accelerator as {GLOO_LINE} (without it every rank trains alone; see "
        f"{DOCS}); otherwise request nvidia.com/gpu. Do not add use_cpu: it turns DeepSpeed "
        "into plain DDP"
    )


def build_expectation_env(dtype: str, world_size: int) -> dict[str, str]:
    """The env the launch gives every rank of a DEEPSPEED job (empty for other types)."""
    if dtype != "DEEPSPEED":
        return {}
    return {ENV_EXPECTED_DISTRIBUTED_TYPE: dtype, ENV_EXPECTED_WORLD_SIZE: str(world_size)}


def check_accelerator(accelerator: Any, environ: Mapping[str, str] | None = None) -> None:
    """Raise DistributedMismatch when the accelerator's distributed_type or world size is not
    what the trainer launched. Without the trainer's env (a run outside a job) it checks
    nothing. Call it right after building the Accelerator: every rank fails before training."""
    environ = os.environ if environ is None else environ
    want_type = environ.get(ENV_EXPECTED_DISTRIBUTED_TYPE)
    want_size = environ.get(ENV_EXPECTED_WORLD_SIZE)
    got_type = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    got_size = accelerator.num_processes
    if want_type and got_type != want_type:
        raise DistributedMismatch(
            f"the job launched {want_type} but accelerate set up {got_type} in rank "
            f"{accelerator.process_index}: {_hint(want_type, got_type, got_size)}"
        )
    if want_size and got_size != int(want_size):
        raise DistributedMismatch(
            f"the job launched world size {want_size} but rank {accelerator.process_index} "
            f"sees {got_size}: the ranks would train unsynchronised. "
            f"{_hint(want_type, got_type, got_size)}"
        )


def check_finished_rank(environ: Mapping[str, str] | None = None) -> str | None:
    """The same comparison, made by fast_exit after a rank's script returned 0, over the
    Accelerator the script built: a script that never called check_accelerator, whose ranks each
    trained alone, then fails instead of succeeding. The message, or None (nothing to check: no
    expectation, or no Accelerator built)."""
    environ = os.environ if environ is None else environ
    state = sys.modules.get("accelerate.state")  # never imported here: only what the script did
    if ENV_EXPECTED_WORLD_SIZE not in environ or state is None or not state.is_initialized():
        return None
    try:
        check_accelerator(state.AcceleratorState(), environ)
    except DistributedMismatch as error:
        return f"{error} (checked after the script returned; call check_accelerator right " \
               "after building the Accelerator to stop before training)"
    return None


def _hint(want: str | None, got: str, size: int) -> str:
    # Without a backend, accelerate 1.15 still says DEEPSPEED (the plugin is there), alone.
    if want == "DEEPSPEED" and got in ("NO", "DEEPSPEED") and size == 1:
        return (f"On pods without GPUs accelerate picks no backend for DeepSpeed; build the "
                f"accelerator as {GLOO_LINE} ({DOCS})")
    if want == "DEEPSPEED" and got == "MULTI_CPU":
        return ("use_cpu / ACCELERATE_USE_CPU turns DeepSpeed into plain DDP; remove it and set "
                f"{ENV_DEEPSPEED_ON_CPU}=1 instead ({DOCS})")
    return "Check the accelerate config and the script's Accelerator arguments"
