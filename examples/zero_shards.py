"""What each rank of a DeepSpeed ZeRO run holds, printed so that a reader (or a test) can see
that the state really is sharded: `train.py --report-shards`.

Every rank prints what it holds of its own, and rank 0 gathers the whole model and prints, for
each rank, the sum of the slice that rank should hold. The two agree only when each rank's shard
is its own slice of the model:

  SHARD rank=<r> stage=<1|2|3> what=<optimizer|parameters> numel=<n> total=<N>
        max_fraction=<f> adam_numel=<a> sum=<float>                     every rank
  SLICES stage=<s> world=<w> sums=<sum of rank 0's slice>,...,<rank w-1's>  rank 0

ZeRO-1/2 (`what=optimizer`): the rank's fp32 master partition of the flattened parameters, and the
numel of its Adam `exp_avg`; `total` is the model's numel. ZeRO-3 (`what=parameters`): the rank's
partition (`ds_tensor`) of every parameter; `max_fraction` is the largest share of any one
parameter it holds. Sums are float64 over the values, printed with 17 digits.
"""

from __future__ import annotations

import torch


def report_shards(accelerator, engine, emit) -> None:
    """A collective (rank 0 gathers ZeRO-3 parameters): every rank calls it."""
    stage = engine.zero_optimization_stage()
    optimizer = engine.optimizer
    world, rank = accelerator.num_processes, accelerator.process_index
    if stage == 3:
        shard, expected = _stage3(engine, world, rank)
    elif stage in (1, 2):
        shard, expected = _stage12(optimizer, world, rank)
    else:
        return
    emit(f"SHARD rank={rank} stage={stage} " + " ".join(f"{k}={v}" for k, v in shard.items()))
    if accelerator.is_main_process:
        emit(f"SLICES stage={stage} world={world} sums={','.join(map(_num, expected))}")


def _stage12(optimizer, world: int, rank: int):
    """The fp32 partition of each parameter group, against the slices of the model's flattened
    parameters (every rank holds the whole model under ZeRO-1/2)."""
    numel = adam = total = 0
    own = 0.0
    expected = [0.0] * world
    fraction = 0.0
    for index, partition in enumerate(optimizer.single_partition_of_fp32_groups):
        params = optimizer.round_robin_bit16_groups[index]
        full = torch.cat([p.detach().reshape(-1).double() for p in params])
        size = partition.numel()
        numel += size
        total += full.numel()
        fraction = max(fraction, size / full.numel())
        own += partition.detach().double().sum().item()
        state = optimizer.optimizer.state.get(partition, {})
        adam += state["exp_avg"].numel() if "exp_avg" in state else 0
        for r in range(world):
            expected[r] += full[r * size:(r + 1) * size].sum().item()
    shard = {"what": "optimizer", "numel": numel, "total": total,
             "max_fraction": f"{fraction:.4f}", "adam_numel": adam, "sum": _num(own)}
    return shard, expected


def _stage3(engine, world: int, rank: int):
    """Each parameter's local partition (ds_tensor), against the slices of the gathered one."""
    import deepspeed

    params = list(engine.module.parameters())
    numel = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    fraction = max(p.ds_tensor.numel() / p.ds_numel for p in params)
    own = sum(_own_slice(p, rank).double().sum().item() for p in params)
    expected = [0.0] * world
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for p in params:
            full = p.detach().reshape(-1).double()
            size = p.ds_tensor.numel()
            for r in range(world):
                expected[r] += full[r * size:(r + 1) * size].sum().item()
    shard = {"what": "parameters", "numel": numel, "total": total,
             "max_fraction": f"{fraction:.4f}", "adam_numel": _stage3_adam(engine),
             "sum": _num(own)}
    return shard, expected


def _own_slice(param, rank: int) -> torch.Tensor:
    """The partition without the padding the last ranks carry past the parameter's end (it is
    not zeroed)."""
    size = param.ds_tensor.numel()
    real = max(0, min(size, param.ds_numel - rank * size))
    return param.ds_tensor.detach().reshape(-1)[:real]


def _stage3_adam(engine) -> int:
    state = engine.optimizer.optimizer.state
    return sum(s["exp_avg"].numel() for s in state.values() if "exp_avg" in s)


def _num(value: float) -> str:
    return f"{value:.17g}"
