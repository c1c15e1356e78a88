"""Where a job's topology and files come from: the spec or the accelerate YAML (never silently),
files shipped beside the YAML, and the DeepSpeed and FSDP checks run before any rank starts."""

from __future__ import annotations

from datetime import datetime

import pytest
import yaml
from accelerate_operator.api import SpecError, parse_job
from accelerate_operator.lifecycle import JobError, run_lifecycle
from accelerate_operator.resources.configmap import ConfigSource, prepare_config
from accelerate_trainer.config import ConfigError, check_job_fits
from accelerate_trainer.deepspeed_checks import check_deepspeed, parse_deepspeed_json
from accelerate_trainer.fsdp_checks import check_fsdp
from accelerate_trainer.schema import load as load_schema

from tests.helpers.jobs import JobBuilder

NOW = datetime(2026, 1, 1)


def job_body(config=None, **spec):
    body = JobBuilder("t").config(**(config or {"distributed_type": "MULTI_CPU",
                                                "use_cpu": True})).build()
    for key in ("numNodes", "numProcPerNode", "masterPort"):
        del body["spec"][key]
    body["spec"].update(spec)
    return body


# ---- topology ---------------------------------------------------------------------------------


def test_topology_comes_from_the_yaml_when_the_spec_leaves_it_out():
    job = parse_job(job_body({"distributed_type": "MULTI_CPU", "use_cpu": True,
                              "num_machines": 2, "num_processes": 8, "main_process_port": 9999}))
    assert (job.num_nodes, job.nproc_per_node, job.world_size, job.master_port) == (2, 4, 8, 9999)
    assert job.topology_resolved


def test_spec_and_yaml_each_give_part_of_the_topology():
    job = parse_job(job_body({"distributed_type": "MULTI_CPU", "use_cpu": True,
                              "main_process_port": 9999}, numNodes=2, numProcPerNode=4))
    assert (job.num_nodes, job.nproc_per_node, job.master_port) == (2, 4, 9999)


def test_neither_side_gives_the_old_defaults():
    job = parse_job(job_body())
    assert (job.num_nodes, job.nproc_per_node, job.master_port) == (1, 1, 29500)


def test_yaml_processes_that_do_not_divide_over_the_machines_fail_when_children_are_made():
    body = job_body({"distributed_type": "MULTI_CPU", "use_cpu": True, "num_machines": 2,
                     "num_processes": 3})
    job = parse_job(body)
    assert not job.topology_resolved
    with pytest.raises(SpecError, match="num_processes=3 .* does not divide evenly over 2"):
        prepare_config(job, None)


def test_a_contradiction_between_spec_and_yaml_is_rejected_naming_both():
    job = parse_job(job_body({"distributed_type": "MULTI_CPU", "use_cpu": True,
                              "num_machines": 3}, numNodes=2))
    with pytest.raises(ConfigError, match=r"num_machines=3 contradicts spec\.numNodes = 2"):
        prepare_config(job, None)


def test_configmap_topology_waits_for_the_configmap_then_is_recorded_in_status():
    body = job_body()
    del body["spec"]["accelerateConfig"]
    body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": "cm", "key": "a.yaml"}}
    job = parse_job(body)
    assert not job.topology_resolved
    plan = run_lifecycle(job, {}, [], NOW, error=JobError("ConfigMap 'cm' missing"))
    assert "topology" not in plan.status  # nothing known yet: nothing shown

    text = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 2\nnum_processes: 4\n"
    job, _ = prepare_config(job, ConfigSource("cm", "a.yaml", text))
    plan = run_lifecycle(job, {}, [], NOW)
    assert plan.status["topology"] == {"numNodes": 2, "numProcPerNode": 2, "worldSize": 4,
                                       "masterPort": 29500, "summary": "2x2"}
    assert plan.create == (0, 1)
    # A later pass reads the recorded topology without the ConfigMap.
    again = parse_job(body, plan.status)
    assert again.topology_resolved and (again.num_nodes, again.nproc_per_node) == (2, 2)


def test_a_configmap_topology_too_big_for_the_job_name_is_rejected():
    body = job_body()
    body["metadata"]["name"] = "a" * 61
    del body["spec"]["accelerateConfig"]
    body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": "cm", "key": "a.yaml"}}
    text = "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_machines: 11\nnum_processes: 11\n"
    with pytest.raises(SpecError, match="metadata.name is too long for 11 node"):
        prepare_config(parse_job(body), ConfigSource("cm", "a.yaml", text))


@pytest.mark.parametrize("line,message", [
    ("num_machines: 100000", "num_machines=100000 must be an integer from 1 to 1024, the range "
                             "of spec.numNodes"),
    ("main_process_port: 70000", "main_process_port=70000 must be an integer from 1024 to 65535, "
                                 "the range of spec.masterPort"),
    ("main_process_port: 80", "main_process_port=80 must be an integer from 1024 to 65535"),
    ("num_processes: 0", "num_processes=0 must be an integer from 1 to"),
])
def test_a_configmap_topology_out_of_the_crds_ranges_is_refused_naming_the_key(line, message):
    """A ConfigMap's YAML never passes admission: its topology keys get the CRD's ranges for the
    spec fields they stand for here, before any child is made."""
    body = job_body()
    del body["spec"]["accelerateConfig"]
    body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": "cm", "key": "a.yaml"}}
    text = f"distributed_type: MULTI_CPU\nuse_cpu: true\n{line}\n"
    with pytest.raises(SpecError) as refused:
        prepare_config(parse_job(body), ConfigSource("cm", "a.yaml", text))
    assert str(refused.value).startswith("ConfigMap 'cm'") and message in str(refused.value)


def test_the_yamls_topology_keys_have_the_ranges_of_the_spec_fields_they_stand_for():
    """Inline, the CRD refuses a value out of range at admission; from a ConfigMap, the
    operator (api.CONFIG_RANGES): both the ranges of numNodes and masterPort."""
    from accelerate_operator.api import CONFIG_RANGES

    from devtools.cluster import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "accelerate-operator.io_acceleratejobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    inline = spec["properties"]["accelerateConfig"]["properties"]
    for key, field_name in (("num_machines", "numNodes"), ("main_process_port", "masterPort")):
        ranges = {(schema["minimum"], schema["maximum"])
                  for schema in (inline[key], spec["properties"][field_name])}
        assert ranges == {CONFIG_RANGES[key][:2]}, key


# ---- files beside the config ------------------------------------------------------------------

DS_YAML = ("distributed_type: DEEPSPEED\n"
           "deepspeed_config:\n  deepspeed_config_file: {path}\n  zero3_init_flag: false\n"
           "num_processes: 2\n")
DS_JSON = '{"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}'


def render_ds(path: str, files: dict[str, str], template_mounts=()):
    body = job_body(None)
    del body["spec"]["accelerateConfig"]
    body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": "cm", "key": "a.yaml"}}
    if template_mounts:
        body["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [
            {"name": "v", "mountPath": m} for m in template_mounts]
    text = DS_YAML.format(path=path)
    return prepare_config(parse_job(body), ConfigSource("cm", "a.yaml", text,
                                                        {"a.yaml": text, **files}))


@pytest.mark.parametrize("path", ["ds.json", "./ds.json", "../templates/ds.json",
                                  "/home/me/ds.json", "/etc/accelerate/ds.json"])
def test_a_shipped_json_is_found_from_the_path_the_config_gives(path: str):
    _, configmap = render_ds(path, {"ds.json": DS_JSON})
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["deepspeed_config"]["deepspeed_config_file"] == "/etc/accelerate/ds.json"
    assert configmap["data"]["ds.json"] == DS_JSON
    assert "a.yaml" not in configmap["data"]


def test_a_path_into_a_pod_volume_is_left_for_the_trainer_to_check():
    _, configmap = render_ds("/data/ds.json", {}, template_mounts=["/data"])
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["deepspeed_config"]["deepspeed_config_file"] == "/data/ds.json"


def test_a_relative_json_that_is_not_shipped_fails_before_any_pod():
    with pytest.raises(ConfigError, match=r"'ds.json' is not shipped with the config.*"
                                          r"Add 'ds.json' to ConfigMap 'cm'"):
        render_ds("ds.json", {"other.json": "{}"})


def test_a_malformed_shipped_json_fails_naming_line_and_column():
    with pytest.raises(ConfigError, match=r"ConfigMap 'cm' key 'a.yaml': deepspeed_config."
                                          r"deepspeed_config_file 'ds.json'.*not valid JSON.*"
                                          r"line 1 column"):
        render_ds("ds.json", {"ds.json": '{"zero_optimization": '})


def test_inline_files_travel_with_an_inline_config():
    body = job_body({"distributed_type": "DEEPSPEED", "num_processes": 2,
                     "deepspeed_config": {"deepspeed_config_file": "ds.json"}},
                    accelerateConfigFiles={"ds.json": DS_JSON})
    job, configmap = prepare_config(parse_job(body), None)
    assert configmap["data"]["ds.json"] == DS_JSON
    assert (job.num_nodes, job.nproc_per_node) == (1, 2)


@pytest.mark.parametrize(("files", "message"), [
    ({"config.yaml": "x"}, "may not hold 'config.yaml'"),
    ({"sub/ds.json": "x"}, "is not a file name"),
])
def test_inline_file_names_must_be_plain_and_not_hide_the_config(files, message):
    with pytest.raises(SpecError, match=message):
        parse_job(job_body(accelerateConfigFiles=files))


# ---- DeepSpeed JSON checks --------------------------------------------------------------------

DS = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "d.json"}}


@pytest.mark.parametrize(("ds_json", "message"), [
    ({}, "has no zero_optimization section"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not a ZeRO stage"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offloads parameters, which only ZeRO stage 3 does"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
     "is not an offload device"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "no nvme_path is given"),
    ({"zero_optimization": {}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "enables both fp16 and bf16"),
    ({"zero_optimization": {}, "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, "must equal train_micro_batch_size_per_gpu x "
                                         "gradient_accumulation_steps x world size = 4 x 2 x 4"),
    ({"zero_optimization": {}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "is not a multiple of 4 x world size 4"),
    ({"zero_optimization": {}, "train_micro_batch_size_per_gpu": 0}, "must be a positive"),
])
def test_deepspeed_json_that_every_rank_would_refuse_is_named(ds_json, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_deepspeed(DS, ds_json, world_size=4, source="d.json")


def test_consistent_batch_sizes_and_auto_pass():
    check_deepspeed(DS, {"zero_optimization": {"stage": 3}, "train_batch_size": 32,
                         "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                         "bf16": {"enabled": "auto"}, "fp16": {"enabled": False}},
                    world_size=4)


@pytest.mark.parametrize(("extra", "message"), [
    ({"mixed_precision": "bf16"}, "mixed_precision: 'bf16' is set in the accelerate config"),
    ({"deepspeed_config": {"deepspeed_config_file": "d.json", "zero_stage": 2}},
     "deepspeed_config.zero_stage is set in the accelerate config beside"),
])
def test_yaml_keys_accelerate_refuses_beside_a_json_are_named(extra, message):
    with pytest.raises(ConfigError, match=message):
        check_deepspeed({**DS, **extra}, None, world_size=2)


def test_yaml_only_deepspeed_block_is_checked_too():
    with pytest.raises(ConfigError, match="deepspeed_config.offload_param_device='cpu'"):
        check_deepspeed({"distributed_type": "DEEPSPEED",
                         "deepspeed_config": {"zero_stage": 2, "offload_param_device": "cpu"}},
                        None, world_size=2)


def test_multinode_launcher_is_part_of_the_shared_check():
    config = {"distributed_type": "DEEPSPEED",
              "deepspeed_config": {"zero_stage": 2, "deepspeed_multinode_launcher": "pdsh"}}
    with pytest.raises(ConfigError, match="deepspeed_multinode_launcher='pdsh' needs SSH"):
        check_job_fits(config, num_nodes=2, num_processes=4, master_port=29500)


def test_json_must_be_an_object():
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_deepspeed_json("[1]", "d.json")


# ---- FSDP checks ------------------------------------------------------------------------------


def fsdp(**block):
    return {"distributed_type": "FSDP", "fsdp_config": block}


@pytest.mark.parametrize(("block", "message"), [
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "X"},
     "only read with fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP"),
    ({"fsdp_transformer_layer_cls_to_wrap": "X"}, "the policy is NO_WRAP"),
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_min_num_params": 10},
     "only read with fsdp_auto_wrap_policy SIZE_BASED_WRAP"),
    ({"fsdp_sharding_strategy": "FULL_SHARDED"}, "is not one of FULL_SHARD"),
    ({"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD"}, "FSDP2 ignores it"),
    ({"fsdp_version": 2, "fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "(FSDP2)"),
    ({"fsdp_state_dict_type": "FULL"}, "fsdp_state_dict_type"),
    ({"fsdp_auto_wrap_policy": "LAYER_WRAP"}, "fsdp_auto_wrap_policy='LAYER_WRAP'"),
    ({"fsdp_backward_prefetch": "PRE"}, "fsdp_backward_prefetch"),
])
def test_fsdp_keys_are_checked_against_the_installed_accelerate(block, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_fsdp(fsdp(**block), load_schema().fsdp)


def test_fsdp_names_accept_accelerates_numbers_and_any_case():
    check_fsdp(fsdp(fsdp_sharding_strategy=1, fsdp_state_dict_type="sharded_state_dict",
                    fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                    fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
               load_schema().fsdp)


def test_fsdp_block_of_another_distributed_type_is_ignored_as_accelerate_does():
    check_fsdp({"distributed_type": "MEGATRON_LM", "fsdp_config": {"x": 1}})
