"""Config values accelerate would drop or override without an error, named before training.

accelerate 1.15 quietly ignores several settings, depending on the hardware and the backend the
launch ends up with (docs/ignored-config-values.md lists every one, with the accelerate source).
Each gets one of two treatments here:

- it changes what the user asked for (precision, sharding, backend, processes): a ConfigError
  naming the key, the value, why it would be dropped here and the fix. The operator raises it
  before any pod exists when the spec decides it (`check_ignored_values`, run by the render);
  the trainer raises it (exit 78) when only the pod's real hardware decides it
  (`check_pod_hardware`, over what `probe_hardware` saw);
- it is harmless: a warning, returned as text. The operator turns the render's warnings into a
  Warning event and the ConfigWarnings condition; the trainer prints them in the pod's log.

Pure but for `probe_hardware`, which asks torch and PATH what the pod really has: decisions are
made on that, never on names (an image or node called "gpu" proves nothing).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import accelerate_reads
from .errors import ConfigError

# The backend each block configures: accelerate reads the block only when distributed_type
# selects it (commands/launch.py `_validate_launch_command` sets use_fsdp / use_deepspeed /
# use_megatron_lm from distributed_type alone; utils/launch.py `prepare_multi_gpu_env` reads the
# fsdp_* and megatron_lm_* values only under them).
BACKEND_BLOCKS = {
    "fsdp_config": "FSDP",
    "deepspeed_config": "DEEPSPEED",
    "megatron_lm_config": "MEGATRON_LM",
}
# Keys only accelerate's TPU launchers read (commands/launch.py `tpu_launcher`,
# `tpu_pod_launcher`, commands/tpu.py), with the value `accelerate config` writes when unused.
TPU_KEYS = {
    "tpu_name": None, "tpu_zone": None, "tpu_use_cluster": False, "tpu_use_sudo": False,
    "tpu_vm": None, "tpu_env": [], "commands": None, "command_file": None,
}
# Compute capability FP8 needs (accelerate.utils.imports.check_cuda_fp8_capability: 8.9, Ada
# Lovelace or Hopper); below it AcceleratorState trains fp16 with only a log line.
FP8_CAPABILITY = (8, 9)
FALSE_WORDS = ("", "no", "false", "0", "off", "none")


def _truthy(value: Any) -> bool:
    return bool(value) and str(value).strip().lower() not in FALSE_WORDS


def _precision(config: Mapping[str, Any]) -> str:
    return accelerate_reads.precision(config)  # the legacy fp16: true is fp16 too


def _dtype(config: Mapping[str, Any]) -> str:
    return str(config.get("distributed_type", "NO"))


def _is_cpu(config: Mapping[str, Any]) -> bool:
    return accelerate_reads.flag(config, "use_cpu") or _dtype(config) == "MULTI_CPU"


def gpu_ids_of(config: Mapping[str, Any]) -> list[str] | None:
    """The GPU ids the config pins, or None for all of them (the key absent, null or "all").
    Raises ConfigError for ids not written as text (accelerate_reads.gpu_ids)."""
    value = accelerate_reads.gpu_ids(config)
    if value is None or value.strip().lower() in ("all", ""):
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def dynamo_backend(config: Mapping[str, Any]) -> str:
    """The torch.compile backend the launch sets (dynamo_config.dynamo_backend, or the top-level
    dynamo_backend an older `accelerate config` wrote), upper-case; NO when none."""
    block = config.get("dynamo_config") or {}
    value = block.get("dynamo_backend") if isinstance(block, Mapping) else None
    value = value if value is not None else config.get("dynamo_backend")
    return "NO" if value is None or value is False else str(value).upper()


def check_ignored_values(config: Mapping[str, Any], *, gpus_per_pod: int | None,
                         nproc_per_node: int) -> list[str]:
    """What the spec alone decides. Raises ConfigError for a value whose loss would change the
    training; returns the warnings for values whose loss is harmless. `gpus_per_pod` is the
    trainer container's GPU limit in the operator, the GPUs torch sees in the trainer; None when
    unknown."""
    _refuse_lost_values(config, gpus_per_pod=gpus_per_pod, nproc_per_node=nproc_per_node)
    found = (warning(config) for warning in IGNORED_VALUE_WARNINGS)
    return [text for text in found if text is not None]


def _refuse_lost_values(config: Mapping[str, Any], *, gpus_per_pod: int | None,
                        nproc_per_node: int) -> None:
    """A backend block its type never reads, a precision a CPU job cannot train in, gpu_ids the
    pod cannot honour: their loss would change the training, so they are refused first."""
    _refuse_unread_blocks(config)
    _refuse_cpu_precision(config)
    ids = gpu_ids_of(config)
    if ids is None or _is_cpu(config) or gpus_per_pod is None or _dtype(config) == "NO":
        return
    _check_gpu_ids(config, ids, gpus_per_pod, nproc_per_node)


def _refuse_unread_blocks(config: Mapping[str, Any]) -> None:
    """A backend block under another distributed_type: none of its settings would apply."""
    dtype = _dtype(config)
    for block, owner in BACKEND_BLOCKS.items():
        value = config.get(block)
        if value and dtype != owner:
            raise ConfigError(
                f"{block} is set ({_short(value)}) but distributed_type is {dtype}: accelerate "
                f"reads {block} only when distributed_type is {owner}, so it would train "
                f"{_what(dtype, _is_cpu(config))} and none of these settings would apply. Set "
                f"distributed_type: {owner} to use them, or delete the {block} block"
            )


def _refuse_cpu_precision(config: Mapping[str, Any]) -> None:
    """fp16 and fp8 on a CPU job: accelerate would train every step in fp32 instead."""
    if not _is_cpu(config):
        return
    if _precision(config) == "fp16":
        raise ConfigError(
            f"{accelerate_reads.said_precision(config)} on a CPU job (use_cpu: true or "
            "MULTI_CPU): accelerate turns "
            "fp16 autocast on only on accelerators (Accelerator.__init__ leaves native_amp off "
            "when the device is cpu), so every step would run in fp32 without a word. Use bf16, "
            "which CPU autocast supports, or mixed_precision: 'no'; or request nvidia.com/gpu "
            "and drop use_cpu / MULTI_CPU"
        )
    if _precision(config) == "fp8":
        raise ConfigError(
            "mixed_precision fp8 needs GPUs with FP8 support (Hopper or newer, with "
            "TransformerEngine, MS-AMP or torchao) but this is a CPU job (use_cpu: true or "
            "MULTI_CPU); use bf16 or request nvidia.com/gpu"
        )


def _gpu_ids_on_cpu(config: Mapping[str, Any]) -> str | None:
    """A CPU job uses no GPU, so the render leaves gpu_ids out."""
    if gpu_ids_of(config) is None or not _is_cpu(config):
        return None
    return (
        f"gpu_ids {config.get('gpu_ids')!r} is ignored: this is a CPU job (use_cpu: true or "
        "MULTI_CPU), which uses no GPU; the operator leaves it out of the rendered config "
        "(accelerate would set CUDA_VISIBLE_DEVICES from it, and on one machine refuse fewer "
        "than two ids). Delete gpu_ids to silence this"
    )


def _downcast_bf16_off_tpu(config: Mapping[str, Any]) -> str | None:
    """downcast_bf16 acts only on TPUs; elsewhere bf16 runs as mixed_precision says."""
    downcast, dtype = config.get("downcast_bf16"), _dtype(config)
    if not _truthy(downcast) or dtype == "XLA":
        return None
    return (
        f"downcast_bf16 {downcast!r} is ignored: accelerate reads it only on TPUs "
        f"(AcceleratorState sets XLA_DOWNCAST_BF16 under XLA); with {dtype} bf16 runs as "
        "mixed_precision says. Set downcast_bf16: 'no' to silence this"
    )


def _fp8_config_without_fp8(config: Mapping[str, Any]) -> str | None:
    """fp8_config is read only with mixed_precision fp8."""
    precision = _precision(config)
    if not config.get("fp8_config") or precision == "fp8":
        return None
    return (
        f"fp8_config is ignored: mixed_precision is {precision!r}, and accelerate reads "
        "fp8_config only with mixed_precision fp8 (prepare_multi_gpu_env calls "
        "setup_fp8_env only then). Delete fp8_config, or set mixed_precision: fp8"
    )


def _cpu_affinity_on_cpu(config: Mapping[str, Any]) -> str | None:
    """CPU affinity follows the GPUs' NUMA nodes, so a CPU job has none to follow."""
    if not _truthy(config.get("enable_cpu_affinity")) or not _is_cpu(config):
        return None
    return (
        "enable_cpu_affinity is ignored on a CPU job: accelerate pins each process to the "
        "NUMA node of its GPU (override_numa_affinity acts only when CUDA is available). "
        "Set it to false to silence this"
    )


def _mpirun_config_unused(config: Mapping[str, Any]) -> str | None:
    """The pods launch through torchrun, so mpirun's settings never apply."""
    if not config.get("mpirun_config"):
        return None
    return (
        f"mpirun_config ({_short(config['mpirun_config'])}) is ignored: the pods launch "
        "every process through torchrun over gloo, not mpirun, with the same ranks. Delete "
        "mpirun_config to silence this"
    )


def _tpu_keys_off_tpu(config: Mapping[str, Any]) -> str | None:
    """Only accelerate's TPU launchers read the TPU keys; an unused default says nothing."""
    dtype = _dtype(config)
    if dtype == "XLA":
        return None
    tpu = [key for key, unused in TPU_KEYS.items()
           if key in config and config[key] not in (unused, None, [], "", False)]
    if not tpu:
        return None
    return (
        f"{', '.join(tpu)} {'is' if len(tpu) == 1 else 'are'} ignored: only accelerate's "
        f"TPU launchers read {'it' if len(tpu) == 1 else 'them'} (distributed_type XLA "
        f"with tpu_use_cluster), and this job is {dtype}. Delete "
        f"{'it' if len(tpu) == 1 else 'them'} to silence this"
    )


def _main_training_function_unused(config: Mapping[str, Any]) -> str | None:
    """`accelerate launch` runs the script as a program, never a function by name."""
    function = config.get("main_training_function")
    if function in (None, "main"):
        return None
    return (
        f"main_training_function {function!r} is ignored: `accelerate launch` runs the "
        "script as a program (only the TPU pod launcher calls a function by name). Delete "
        "it to silence this"
    )


def _main_process_ip_replaced(config: Mapping[str, Any]) -> str | None:
    """Machine 0's address is the job's headless Service, whatever the config says."""
    if config.get("main_process_ip") in (None, ""):
        return None
    return (
        f"main_process_ip {config['main_process_ip']!r} is replaced: every pod reaches "
        "machine 0 through the job's headless Service (<job>-0.<job>), passed as "
        "--main_process_ip. Delete it to silence this"
    )


# The harmless losses, in the order their warnings are listed.
IGNORED_VALUE_WARNINGS: tuple[Callable[[Mapping[str, Any]], str | None], ...] = (
    _gpu_ids_on_cpu,
    _downcast_bf16_off_tpu,
    _fp8_config_without_fp8,
    _cpu_affinity_on_cpu,
    _mpirun_config_unused,
    _tpu_keys_off_tpu,
    _main_training_function_unused,
    _main_process_ip_replaced,
)


def _check_gpu_ids(config: Mapping[str, Any], ids: list[str], gpus: int,
                   nproc_per_node: int) -> None:
    """gpu_ids becomes CUDA_VISIBLE_DEVICES in every pod, whose GPUs are numbered 0..N-1."""
    outside = [i for i in ids if not i.isdigit() or int(i) >= gpus]
    if outside:
        raise ConfigError(
            f"gpu_ids {config.get('gpu_ids')!r} names GPU(s) {', '.join(outside)} but each pod "
            f"has {gpus} GPU(s), numbered 0 to {gpus - 1}: CUDA would hide every GPU from the "
            "first bad id on and ranks would fail or share devices. Use gpu_ids: all (the pod "
            "only ever sees its own GPUs), or ids below the nvidia.com/gpu limit"
        )
    if len(ids) < nproc_per_node:
        raise ConfigError(
            f"gpu_ids {config.get('gpu_ids')!r} makes {len(ids)} GPU(s) visible but each pod "
            f"runs {nproc_per_node} process(es), one per GPU: the extra ranks would find no "
            "device. Use gpu_ids: all, or list as many ids as spec.numProcPerNode"
        )


@dataclass(frozen=True)
class PodHardware:
    """What the pod really has, as torch and PATH see it (probe_hardware)."""

    gpus: int | None = None  # CUDA devices torch sees; None when not probed
    capabilities: tuple[tuple[int, int], ...] = ()  # compute capability of each visible GPU
    cxx_compiler: str | None = None  # what inductor's C++ code (CPU) would be built with
    c_compiler: str | None = None  # what Triton's launcher stubs (GPU) would be built with
    triton: bool = False


def probe_hardware(config: Mapping[str, Any], *, gpus: int | None = None) -> PodHardware:
    """Ask only what the config's checks need: torch is imported for the GPUs' compute
    capability when fp8 asks for it; compilers are looked up only for the inductor backend.
    `gpus` is the device count the caller already has (count_visible_gpus)."""
    capabilities: tuple[tuple[int, int], ...] = ()
    if _precision(config) == "fp8" and gpus:
        import torch

        capabilities = tuple(tuple(torch.cuda.get_device_capability(i)) for i in range(gpus))
    cxx = c = None
    triton = False
    if dynamo_backend(config) == "INDUCTOR":
        # torch._inductor.config.cpp.cxx: $CXX, else g++; or conda-forge's gcc, which
        # cpp_compiler_search installs only when TORCH_INDUCTOR_INSTALL_GXX is set.
        cxx = shutil.which(os.environ.get("CXX") or "g++")
        if cxx is None and os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
            cxx = shutil.which("conda")
        # triton/runtime/build.py: $CC, else the first of clang, gcc, cc on PATH.
        c = next((found for name in (os.environ.get("CC"), "clang", "gcc", "cc") if name
                  for found in [shutil.which(name)] if found), None)
        triton = importlib.util.find_spec("triton") is not None
    return PodHardware(gpus=gpus, capabilities=capabilities, cxx_compiler=cxx, c_compiler=c,
                       triton=triton)


def check_pod_hardware(config: Mapping[str, Any], hardware: PodHardware) -> None:
    """What only the pod's real hardware decides; raises ConfigError (the trainer exits 78)."""
    cpu = _is_cpu(config)
    if _precision(config) == "fp16" and not cpu and hardware.gpus == 0:
        # A CPU job is refused by check_ignored_values already; this is a config that does not
        # say CPU (distributed_type NO, say) on a pod whose torch sees no GPU.
        raise ConfigError(
            f"{accelerate_reads.said_precision(config)} on a pod whose torch sees no GPU: "
            "accelerate then trains on "
            "the CPU, where it turns fp16 autocast off (Accelerator.__init__ leaves native_amp "
            "off for the cpu device), so every step would run in fp32 without a word. Request "
            "nvidia.com/gpu in the template, or use bf16 or mixed_precision: 'no' to train on CPU"
        )
    if _precision(config) == "fp8" and hardware.capabilities:
        weak = [f"{major}.{minor}" for major, minor in hardware.capabilities
                if (major, minor) < FP8_CAPABILITY]
        if weak:
            raise ConfigError(
                f"mixed_precision fp8 on GPUs of compute capability {', '.join(sorted(set(weak)))}"
                f": accelerate needs {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada "
                "Lovelace, Hopper) and below it trains fp16 instead with only a log line "
                "(AcceleratorState.__init__). Use bf16 or fp16 on these GPUs, or schedule the "
                "job on FP8 GPUs (a nodeSelector on the GPU product)"
            )
    if dynamo_backend(config) == "INDUCTOR":
        on_gpu = not cpu and bool(hardware.gpus)
        if not on_gpu and hardware.cxx_compiler is None:
            raise ConfigError(
                "dynamo_config.dynamo_backend INDUCTOR compiles C++ for the CPU, but this image "
                "has no C++ compiler ($CXX, else g++, is not on PATH), so "
                "torch.compile would fail in every rank. Install g++ in the image (or set CXX), "
                "or use dynamo_backend: 'NO' (or AOT_EAGER)"
            )
        if on_gpu and (not hardware.triton or hardware.c_compiler is None):
            missing = "the triton package" if not hardware.triton else "a C compiler (cc, gcc)"
            raise ConfigError(
                f"dynamo_config.dynamo_backend INDUCTOR builds Triton kernels on the GPU, but "
                f"this image lacks {missing}, so torch.compile would fail in every rank. "
                "Install it in the image (or set CC), or use dynamo_backend: 'NO'"
            )


def _short(value: Any) -> str:
    text = repr(dict(value)) if isinstance(value, Mapping) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _what(dtype: str, cpu: bool) -> str:
    if dtype == "NO":
        return "one process without any sharding"
    if cpu or dtype == "MULTI_CPU":
        return "plain DDP on CPU"
    if dtype in ("MULTI_GPU",):
        return "plain DDP"
    return dtype


def check_in_pod(config: Mapping[str, Any], *, nproc_per_node: int,
                 hardware: PodHardware) -> list[str]:
    """The trainer's hook, before launch: every check of this module over the rendered config
    and what the pod really has (gpu_ids against the GPUs torch sees). Raises ConfigError;
    returns the warnings to print in the pod's log."""
    warnings = check_ignored_values(config, gpus_per_pod=hardware.gpus,
                                    nproc_per_node=nproc_per_node)
    check_pod_hardware(config, hardware)
    return warnings
