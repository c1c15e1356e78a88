"""accelerate's own config files (tests/accelerate_corpus) and what each must do here: the one
record shared by the unit test (render and validation) and the end-to-end test (on the cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

CORPUS = Path(__file__).resolve().parents[1] / "accelerate_corpus"
TEMPLATES = CORPUS / "config_yaml_templates"
TEST_CONFIGS = CORPUS / "test_configs"
DEEPSPEED_JSONS = CORPUS / "deepspeed_config_templates"

NEEDS_GPUS = "needs GPUs but this pod sees none"
FP8 = "mixed_precision fp8 needs GPUs with FP8 support"
IPEX = ("accelerate config key ipex_config was written by accelerate 0.x (0.28's `accelerate "
        "config` wrote it for Intel Extension for PyTorch); this image has accelerate 1.")


IGNORED_BLOCK = "accelerate reads fsdp_config only when distributed_type is FSDP"
TPU_KEYS = "tpu_name, tpu_zone, command_file are ignored"
MPIRUN = "mpirun_config ({'mpirun_ccl': '1', 'mpirun_hostfile': '/home/user/hostfile'}) is ignored"
MAIN_IP = "is replaced: every pod reaches machine 0 through the job's headless Service"


class Expect(NamedTuple):
    """What one file does. None = passes; a string = fails with a message containing it.
    `warns`: one substring per warning the render gives (values accelerate would drop
    harmlessly: a Warning event and the ConfigWarnings condition), in order."""

    topology: tuple[int, int, int] | None  # nodes, processes per node, port (None: render fails)
    render: str | None
    on_gpu_pod: str | None
    on_cpu_pod: str | None
    warns: tuple[str, ...] = ()

    def outcome(self, pod: str) -> str:
        """What a user sees, in words, on a `pod` ("GPU" or "CPU") pod."""
        if self.render:
            return "refused before any pod"
        refusal = self.on_gpu_pod if pod == "GPU" else self.on_cpu_pod
        if refusal:
            return "refused in the pod (exit 78)"
        return "warned, trained" if self.warns else "trained as written"


CORPUS_TABLE = {
    # examples/config_yaml_templates
    "config_yaml_templates/deepspeed.yaml": Expect((1, 2, 29500), None, None, NEEDS_GPUS),
    "config_yaml_templates/fp8.yaml": Expect((1, 1, 29500), None, None, FP8),
    "config_yaml_templates/fsdp.yaml": Expect((1, 2, 29500), None, None, NEEDS_GPUS),
    "config_yaml_templates/multi_gpu.yaml": Expect((1, 2, 29500), None, None, NEEDS_GPUS),
    "config_yaml_templates/multi_node.yaml": Expect((2, 4, 9999), None, None, NEEDS_GPUS,
                                                   ("main_process_ip '1234' " + MAIN_IP,)),
    "config_yaml_templates/multi_xpu.yaml": Expect((1, 2, 29500), None, None,
                                                   "MULTI_XPU needs Intel XPUs"),
    "config_yaml_templates/single_accelerator.yaml": Expect((1, 1, 29500), None, None, None),
    "config_yaml_templates/single_gpu.yaml": Expect((1, 1, 29500), None, None, None),
    # tests/test_configs
    "test_configs/0_11_0.yaml": Expect((1, 1, 29500), None, None, None),
    "test_configs/0_12_0.yaml": Expect((1, 1, 29500), None, None, None),
    "test_configs/0_28_0_mpi.yaml": Expect((4, 4, 29500), None, IPEX, IPEX,
                                           (MPIRUN, "main_process_ip '127.0.0.1' " + MAIN_IP)),
    "test_configs/0_30_0_sagemaker.yaml": Expect(
        None, "compute_environment 'AMAZON_SAGEMAKER' launches on Amazon SageMaker", None, None),
    "test_configs/0_34_0_fp8.yaml": Expect((1, 2, 29500), None, None, FP8),
    "test_configs/debug.yaml": Expect((1, 1, 29500), None, None, None),
    "test_configs/downcast.yaml": Expect((1, 1, 29500), None, None, None, (TPU_KEYS,)),
    # fsdp_config beside MEGATRON_LM: accelerate's own test that the block is ignored.
    "test_configs/fsdp.yaml": Expect(None, "distributed_type is MEGATRON_LM: " + IGNORED_BLOCK,
                                     None, None),
    "test_configs/invalid_keys.yaml": Expect(
        (1, 1, 29500), None, "unknown accelerate config key(s) another_invalid_key, invalid_key",
        "unknown accelerate config key(s) another_invalid_key, invalid_key"),
    "test_configs/latest.yaml": Expect((1, 1, 29500), None,
                                       "command (did you mean commands?)",
                                       "command (did you mean commands?)", (TPU_KEYS,)),
    "test_configs/latest_fsdp.yaml": Expect((1, 1, 29500), None, None, NEEDS_GPUS),
    "test_configs/megatron.yaml": Expect((1, 1, 29500), None, None, NEEDS_GPUS),
    "test_configs/mpi_multicpu.yaml": Expect((4, 4, 29500), None, IPEX, IPEX,
                                             (MPIRUN, "main_process_ip '127.0.0.1' " + MAIN_IP)),
    "test_configs/one_proc.yaml": Expect((1, 1, 29500), None, None, None),
    # fsdp_config and deepspeed_config under NO: accelerate's test that both are ignored.
    "test_configs/validate_launch_cmd.yaml": Expect(
        None, "distributed_type is NO: " + IGNORED_BLOCK, None, None),
}

# Written by `accelerate config` itself (devtools/write_accelerate_configs.py), one folder per
# accelerate version: the keys 1.10-1.15 added (rendezvous, FSDP2, ND parallelism, dynamo).
W15 = "written_by_accelerate/1.15.0/"
CORPUS_TABLE.update({
    W15 + "multi_node_c10d.yaml": Expect((2, 2, 29500), None, None, NEEDS_GPUS,
                                         ("main_process_ip '10.0.0.1' " + MAIN_IP,)),
    W15 + "multi_node_same_network.yaml": Expect((2, 2, 29500), None, None, NEEDS_GPUS,
                                                 ("main_process_ip '10.0.0.1' " + MAIN_IP,)),
    W15 + "multi_node_etcd.yaml": Expect(None, "rdzv_backend 'etcd'", None, None),
    W15 + "fsdp2_parallelism.yaml": Expect((1, 4, 29500), None, None, NEEDS_GPUS),
    W15 + "dynamo_inductor.yaml": Expect((1, 2, 29500), None, None, NEEDS_GPUS),
    W15 + "multi_cpu.yaml": Expect((1, 4, 29500), None, None, None),
})

# The JSON each DeepSpeed file names, shipped in the same ConfigMap.
SHIPPED = {"config_yaml_templates/deepspeed.yaml": ["zero_stage1_config.json"]}


def corpus_files() -> list[str]:
    found = [*CORPUS.glob("*/*.yaml"), *CORPUS.glob("written_by_accelerate/*/*.yaml")]
    return sorted(str(p.relative_to(CORPUS)) for p in found)


OUTCOMES_BEGIN = "<!-- outcomes: generated from tests/helpers/corpus.py, checked by a unit test -->"
OUTCOMES_END = "<!-- end of outcomes -->"


def outcome_table() -> str:
    """The README's record of each file's outcome, from the table above."""
    rows = ["| file | on a GPU pod (unit test) | on a CPU pod (unit + e2e) | why |",
            "|---|---|---|---|"]
    for relative, expect in sorted(CORPUS_TABLE.items()):
        why = expect.render or expect.on_cpu_pod or expect.on_gpu_pod or ""
        if expect.warns and not expect.render:
            why = "; ".join(filter(None, [why, "warns: " + "; ".join(expect.warns)]))
        why = why.replace("|", "/")
        rows.append(f"| `{relative}` | {expect.outcome('GPU')} | {expect.outcome('CPU')} | "
                    f"{why[:140] + ('...' if len(why) > 140 else '')} |")
    return "\n".join([OUTCOMES_BEGIN, *rows, OUTCOMES_END])
