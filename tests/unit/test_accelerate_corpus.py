"""Every config accelerate ships (tests/accelerate_corpus, vendored from huggingface/accelerate),
run as a user would: in a ConfigMap (with the files beside it), named by a job that gives no
topology of its own. Each goes through the operator's render (`prepare_config`), then the
trainer's validation as in a GPU pod and as in a CPU pod, and the table says what must happen.

The table is the record of what each file does; tests/e2e/test_accelerate_corpus_on_cluster.py
runs the same files on the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from accelerate_operator.api import SpecError, parse_job
from accelerate_operator.resources.configmap import ConfigSource, prepare_config
from accelerate_trainer.__main__ import read_deepspeed_json, validate
from accelerate_trainer.config import ConfigError, is_cpu_job
from accelerate_trainer.contract import CONFIG_KEY, CONFIG_MOUNT_PATH
from accelerate_trainer.ignored import PodHardware, check_in_pod
from accelerate_trainer.topology import Topology

from tests.helpers.corpus import (
    CORPUS,
    CORPUS_TABLE,
    DEEPSPEED_JSONS,
    OUTCOMES_BEGIN,
    OUTCOMES_END,
    SHIPPED,
    TEMPLATES,
    corpus_files,
    outcome_table,
)
from tests.helpers.jobs import JobBuilder


def test_the_table_covers_every_vendored_config():
    assert sorted(CORPUS_TABLE) == corpus_files()


def test_the_corpus_readme_records_each_files_outcome_as_the_table_says():
    readme = (CORPUS / "README.md").read_text()
    start, end = readme.index(OUTCOMES_BEGIN), readme.index(OUTCOMES_END) + len(OUTCOMES_END)
    assert readme[start:end] == outcome_table(), (
        "tests/accelerate_corpus/README.md is stale: paste outcome_table() from "
        "tests/helpers/corpus.py between its markers")


def job_without_topology(name: str = "corpus") -> dict:
    body = JobBuilder(name).config_from("corpus", "accelerate.yaml").build()
    for key in ("numNodes", "numProcPerNode", "masterPort"):
        del body["spec"][key]
    return body


def source_for(relative: str, text: str | None = None, **files: str) -> ConfigSource:
    path = CORPUS / relative
    shipped = {name: (DEEPSPEED_JSONS / name).read_text() for name in SHIPPED.get(relative, [])}
    text = path.read_text() if text is None else text
    return ConfigSource(name="corpus", key="accelerate.yaml", text=text,
                        files={"accelerate.yaml": text, **shipped, **files})


def render(relative: str, body: dict | None = None, **kwargs):
    job = parse_job(body or job_without_topology())
    return prepare_config(job, source_for(relative, **kwargs))


def mount(configmap: dict, into: Path) -> Path:
    """What the pod sees in /etc/accelerate, written under `into` (paths rewritten to match)."""
    for key, text in configmap["data"].items():
        (into / key).write_text(text.replace(CONFIG_MOUNT_PATH, str(into)))
    return into / CONFIG_KEY


def trainer_validates(config_file: Path, job, *, visible_gpus: int) -> list[str]:
    """The trainer's checks in a pod that sees `visible_gpus` GPUs (of FP8-capable compute
    capability, with compilers); returns the warnings it logs."""
    config = yaml.safe_load(config_file.read_text())
    topology = Topology(master_addr="corpus-0.corpus", master_port=job.master_port, node_rank=0,
                        num_nodes=job.num_nodes, nproc_per_node=job.nproc_per_node,
                        world_size=job.world_size, config_file=str(config_file))
    deepspeed_json, source = read_deepspeed_json(config, str(config_file))
    gpus = None if is_cpu_job(config) else visible_gpus
    validate(topology, config, visible_gpus=gpus, deepspeed_json=deepspeed_json,
             deepspeed_source=source)
    hardware = PodHardware(gpus=gpus, capabilities=((9, 0),) * (gpus or 0), cxx_compiler="g++",
                           c_compiler="gcc", triton=True)
    return check_in_pod(config, nproc_per_node=job.nproc_per_node, hardware=hardware)


def outcome(check) -> str | None:
    try:
        check()
    except (ConfigError, SpecError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("relative", sorted(CORPUS_TABLE))
def test_corpus_config_renders_and_validates_as_recorded(relative: str, tmp_path: Path):
    expect = CORPUS_TABLE[relative]
    try:
        job, configmap = render(relative)
    except (ConfigError, SpecError) as error:
        assert expect.render and expect.render in str(error), str(error)
        assert expect.topology is None
        return
    assert expect.render is None, f"rendered, but expected: {expect.render}"
    assert (job.num_nodes, job.nproc_per_node, job.master_port) == expect.topology
    assert len(job.config_warnings) == len(expect.warns), job.config_warnings
    for warning, wanted in zip(job.config_warnings, expect.warns, strict=True):
        assert warning.startswith("ConfigMap 'corpus' key 'accelerate.yaml': "), warning
        assert wanted in warning, warning
    rendered = yaml.safe_load(configmap["data"][CONFIG_KEY])
    assert rendered["num_machines"] == job.num_nodes
    assert rendered["num_processes"] == job.world_size
    assert rendered["main_process_port"] == job.master_port
    assert "machine_rank" not in rendered and "main_process_ip" not in rendered
    # libyaml's emitter (configmap.py) writes the text the pure-Python one wrote before it
    assert configmap["data"][CONFIG_KEY] == yaml.safe_dump(rendered, sort_keys=False)

    config_file = mount(configmap, tmp_path)
    for visible, expected in ((job.nproc_per_node, expect.on_gpu_pod), (0, expect.on_cpu_pod)):
        got = outcome(lambda v=visible: trainer_validates(config_file, job, visible_gpus=v))
        if expected is None:
            assert got is None, f"with {visible} GPU(s): {got}"
        else:
            assert got and expected in got, f"with {visible} GPU(s): {got}"


# ---- the two cases of the issue ---------------------------------------------------------------


def multi_node_on_cpu() -> str:
    config = yaml.safe_load((TEMPLATES / "multi_node.yaml").read_text())
    config.update(distributed_type="MULTI_CPU", use_cpu=True)
    return yaml.safe_dump(config)


def test_multi_node_template_keeps_its_port_when_the_spec_gives_nodes_and_processes(
        tmp_path: Path):
    body = job_without_topology()
    body["spec"].update(numNodes=2, numProcPerNode=4)
    job, configmap = render("config_yaml_templates/multi_node.yaml", body,
                            text=multi_node_on_cpu())
    assert (job.num_nodes, job.nproc_per_node, job.world_size, job.master_port) == (2, 4, 8, 9999)
    trainer_validates(mount(configmap, tmp_path), job, visible_gpus=0)


def test_multi_node_template_port_contradicting_the_spec_is_still_rejected():
    body = job_without_topology()
    body["spec"].update(numNodes=2, numProcPerNode=4, masterPort=29500)
    with pytest.raises(ConfigError, match="main_process_port=9999 contradicts spec.masterPort"):
        render("config_yaml_templates/multi_node.yaml", body, text=multi_node_on_cpu())


def test_deepspeed_template_with_its_json_in_the_configmap_validates(tmp_path: Path):
    job, configmap = render("config_yaml_templates/deepspeed.yaml")
    assert configmap["data"]["zero_stage1_config.json"] == (
        DEEPSPEED_JSONS / "zero_stage1_config.json").read_text()
    rendered = yaml.safe_load(configmap["data"][CONFIG_KEY])
    assert rendered["deepspeed_config"]["deepspeed_config_file"] == (
        "/etc/accelerate/zero_stage1_config.json")
    trainer_validates(mount(configmap, tmp_path), job, visible_gpus=2)


def test_deepspeed_template_without_its_json_fails_at_render_naming_the_key():
    job = parse_job(job_without_topology())
    source = ConfigSource(name="corpus", key="accelerate.yaml",
                          text=(TEMPLATES / "deepspeed.yaml").read_text())
    with pytest.raises(ConfigError, match=(
            r"ConfigMap 'corpus' key 'accelerate.yaml': deepspeed_config.deepspeed_config_file "
            r"'\.\./deepspeed_config_templates/zero_stage1_config.json' is not shipped with the "
            r"config.*Add 'zero_stage1_config.json' to ConfigMap 'corpus'")):
        prepare_config(job, source)


@pytest.mark.parametrize("name", sorted(p.name for p in DEEPSPEED_JSONS.glob("*.json")))
def test_every_deepspeed_json_template_validates_with_the_deepspeed_template(
        name: str, tmp_path: Path):
    text = (TEMPLATES / "deepspeed.yaml").read_text().replace("zero_stage1_config.json", name)
    job = parse_job(job_without_topology())
    source = ConfigSource(name="corpus", key="accelerate.yaml", text=text,
                          files={name: (DEEPSPEED_JSONS / name).read_text()})
    job, configmap = prepare_config(job, source)
    trainer_validates(mount(configmap, tmp_path), job, visible_gpus=2)
