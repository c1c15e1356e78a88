"""Write tests/accelerate_corpus/written_by_accelerate/<version>/*.yaml with the installed
accelerate's own questionnaire (`accelerate config`: commands/config/cluster.py
get_cluster_input) and its own writer (ClusterConfig.to_yaml_file). The answers are given by
the question's words instead of a terminal: `input()` answers from ANSWERS (Enter, the default,
for any other question) and the arrow-key menus take the option named. Run:
`python -m devtools.write_accelerate_configs tests/accelerate_corpus/written_by_accelerate`."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import accelerate
from accelerate.commands.config import cluster

# name -> {words of a question: answer}. Menus are answered with the option's text.
MULTI_NODE = {"type of machine": "multi-GPU", "How many different machines": "2",
              "rank of this machine": "0", "IP address of the machine": "10.0.0.1",
              "port you will use": "29500", "How many GPU(s)": "4"}
CONFIGS = {
    "multi_node_c10d": {**MULTI_NODE, "same local network": "no", "rendezvous backend": "c10d"},
    "multi_node_same_network": MULTI_NODE,
    "multi_node_etcd": {**MULTI_NODE, "same local network": "no", "rendezvous backend": "etcd"},
    "fsdp2_parallelism": {"type of machine": "multi-GPU", "How many GPU(s)": "4",
                          "FullyShardedDataParallel": "yes", "What should be your FSDP version":
                          "2", "parallelism config": "yes", "replicate size": "1",
                          "shard size": "2", "tensor parallelism size": "2",
                          "mixed precision": "bf16"},
    "dynamo_inductor": {"type of machine": "multi-GPU", "How many GPU(s)": "2",
                        "torch dynamo": "yes", "Which dynamo backend": "inductor",
                        "customize the defaults": "yes", "Which mode": "max-autotune",
                        "fullgraph": "yes"},
    "multi_cpu": {"type of machine": "multi-CPU", "How many different machines": "1",
                  "How many processes": "4"},
}


def answering(answers: dict[str, str]):
    def find(prompt: str) -> str:
        found = [words for words in answers if words in prompt]
        return answers[max(found, key=len)] if found else ""

    asked: list[str] = []

    def ask_input(prompt: str = "") -> str:
        asked.append(prompt)
        if asked.count(prompt) > 2:
            raise RuntimeError(f"accelerate refused the answer {find(prompt)!r} to {prompt!r}")
        return find(prompt)

    def ask_options(prompt, options=(), convert_value=None, default=0):
        wanted = find(prompt).lower()
        index = next((i for i, option in enumerate(options) if wanted and wanted
                      in str(option).lower()), default)
        return convert_value(index) if convert_value is not None else index

    return ask_input, ask_options


def write(name: str, answers: dict[str, str], folder: Path) -> None:
    ask_input, ask_options = answering(answers)
    original = builtins.input
    builtins.input, cluster._ask_options = ask_input, ask_options
    try:
        config = cluster.get_cluster_input()
    finally:
        builtins.input = original
    config.to_yaml_file(str(folder / f"{name}.yaml"))


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "tests/accelerate_corpus/written_by_accelerate")
    folder = folder / accelerate.__version__
    folder.mkdir(parents=True, exist_ok=True)
    for name, answers in CONFIGS.items():
        write(name, answers, folder)
        print(f"{folder / name}.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
