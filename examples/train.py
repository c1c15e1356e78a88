"""Fine-tune a causal language model with transformers + accelerate: the example an AccelerateJob
runs, and the script the trainer image ships.

By default it trains a tiny Llama built from a config (no download) on a synthetic, learnable
dataset, so it runs anywhere, CPU included: `accelerate launch examples/train.py`. GPU users pass
`--model-name-or-path` and `--dataset` to fine-tune a real model on a real dataset.

Checkpoints go to `$ACCELERATE_CHECKPOINT_DIR/checkpoints/checkpoint_<n>` every `--checkpoint-every`
optimizer steps, marked COMPLETE once every rank has written them. The trainer sets
`ACCELERATE_RESUME_FROM` to the newest complete one after a restart; the run then continues
mid-epoch and still stops after exactly `--max-steps` optimizer steps. With a checkpoint dir, a
SIGTERM (a drained or preempted node, the operator stopping the group) makes every rank finish
its step and save one more complete checkpoint together, then exit 83: the group resumes from
the step it was stopped at.

The lines below are a contract: the tests (and people reading pod logs) parse them.
  RANK_INFO rank=<global> local_rank=<local> world_size=<w> node_rank=<n>    every rank, at start
  SETUP distributed_type=<t> mixed_precision=<p> [zero_stage= offload= | fsdp_sharding=]  rank 0
  RESUMED from=<path> step=<n>                                             rank 0, on resume
  STOPPED checkpoint=<path>                              rank 0, saved on SIGTERM, then exit 83
  HANGING rank=<r> step=<n>                              the rank --hang-at-step blocks
  STEP step=<n> loss=<float> epoch=<e>            rank 0, step 1, every --log-every, and the last
  SHARD ... / SLICES ...        with --report-shards under DeepSpeed ZeRO (zero_shards.py)
  FINAL rank=<r> param_checksum=<float, 8 decimals> steps=<n>              every rank, at the end
  TRAINING_DONE steps=<n> first_loss=<f> last_loss=<f>                     rank 0, at the end
`loss` is the mean over the step's accumulated micro-batches and over all ranks; `first_loss` is
the first loss this process logged (after a resume, the first step after the checkpoint).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    broadcast_object_list,
    set_seed,
)
from accelerate_trainer.checkpoints import (
    checkpoint_on_stop,
    find_resume_checkpoint,
    resume_from_checkpoint,
    save_checkpoint,
    stop_on_signal,
)
from accelerate_trainer.deepspeed_cpu import DistributedMismatch, check_accelerator
from torch.utils.data import DataLoader
from transformers import get_scheduler

try:  # reports progress to the operator; absent in older trainer images
    from accelerate_trainer import progress as progress_reporter
except ImportError:
    progress_reporter = None

FAIL_ONCE_MARKER_ENV = "ACCELERATE_FAIL_ONCE_MARKER"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("model and data")
    data.add_argument("--model-name-or-path", default=None,
                      help="a Hugging Face model id or local path; default: a tiny Llama built "
                           "from a config")
    data.add_argument("--dataset", default=None,
                      help="a dataset for datasets.load_dataset (needs --model-name-or-path for "
                           "its tokenizer); default: synthetic token sequences")
    data.add_argument("--dataset-config", default=None)
    data.add_argument("--dataset-split", default="train")
    data.add_argument("--text-column", default="text")
    data.add_argument("--seq-len", type=int, default=32, help="tokens per training sequence")
    data.add_argument("--num-samples", type=int, default=512,
                      help="size of the synthetic dataset (ignored with --dataset)")

    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=int, default=40, help="optimizer steps to train")
    train.add_argument("--batch-size", type=int, default=8, help="per process, per micro-batch")
    train.add_argument("--gradient-accumulation-steps", type=int, default=2)
    train.add_argument("--learning-rate", type=float, default=1e-2)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--warmup-steps", type=int, default=2)
    train.add_argument("--max-grad-norm", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--log-every", type=int, default=5, help="print a STEP line every N steps")
    train.add_argument("--report-to", default=None,
                       help="an accelerate tracker (tensorboard, wandb, ...) for accelerator.log; "
                            "default: none")

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", default=os.environ.get("ACCELERATE_CHECKPOINT_DIR"),
                      help="project dir for checkpoints (default: $ACCELERATE_CHECKPOINT_DIR)")
    ckpt.add_argument("--checkpoint-every", type=int, default=0,
                      help="save a checkpoint every N optimizer steps (0: never)")
    ckpt.add_argument("--checkpoints-to-keep", type=int, default=3)
    ckpt.add_argument("--resume-from", default=os.environ.get("ACCELERATE_RESUME_FROM") or None,
                      help="checkpoint folder to resume from (default: $ACCELERATE_RESUME_FROM), "
                           "or `latest`: the newest complete one under --checkpoint-dir, for "
                           "launchers that restart the processes themselves (torchrun "
                           "--max-restarts)")

    debug = parser.add_argument_group("debugging (restart and timing tests)")
    debug.add_argument("--fail-at-step", type=int, default=None,
                       help="exit(1) once optimizer step K is done, before it is logged or "
                            "checkpointed; only while the $ACCELERATE_FAIL_ONCE_MARKER file does "
                            "not exist (it is created first). Without that variable: every time")
    debug.add_argument("--fail-rank", type=int, default=0, help="the global rank that fails")
    debug.add_argument("--fail-attempt", type=int, default=None,
                       help="fail only in this whole-group attempt ($ACCELERATE_JOB_ATTEMPT, "
                            "which the operator sets: 0 first, 1 after the first restart...)")
    debug.add_argument("--hang-at-step", type=int, default=None,
                       help="block for ever once optimizer step K is done, on --fail-rank, with "
                            "the same once/attempt rules as --fail-at-step: the other ranks then "
                            "wait in their next collective (a stall)")
    debug.add_argument("--sleep-per-step", type=float, default=0.0,
                       help="seconds to sleep after each optimizer step")
    debug.add_argument("--sleep-until-attempt", type=int, default=None,
                       help="sleep (--sleep-per-step) only in whole-group attempts before this one "
                            "($ACCELERATE_JOB_ATTEMPT): the group a test waits out runs its last "
                            "steps at full speed")
    debug.add_argument("--quiet-end", type=float, default=0.0,
                       help="seconds every rank waits, printing nothing, after TRAINING_DONE (as "
                            "a final save or upload would)")
    debug.add_argument("--report-shards", action="store_true",
                       help="under DeepSpeed ZeRO, print what each rank holds (SHARD and SLICES "
                            "lines, zero_shards.py) at the end")

    args = parser.parse_args(argv)
    if args.dataset and not args.model_name_or_path:
        parser.error("--dataset needs --model-name-or-path (its tokenizer encodes the text)")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir or $ACCELERATE_CHECKPOINT_DIR")
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "log_every", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


class TrainingState:
    """Where the loop is; saved in every checkpoint through `register_for_checkpointing`.

    The position in the epoch counts the micro-batches ALL processes consumed together, not one
    process's: a run resumed at another world size (an elastic job at reduced size) skips the
    same samples, so its data order follows the global step, not the world size."""

    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.global_batches_in_epoch = 0  # micro-batches of `epoch` consumed by all processes

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch,
                "global_batches_in_epoch": self.global_batches_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.global_batches_in_epoch = int(state["global_batches_in_epoch"])

    def batches_to_skip(self, num_processes: int) -> int:
        """This process's share of the micro-batches already consumed in the epoch. accelerate
        deals whole batches round-robin to the processes, so the samples of every optimizer
        step are the same at any world size with the same global batch."""
        if self.global_batches_in_epoch % num_processes:
            raise SystemExit(
                f"the checkpoint stopped {self.global_batches_in_epoch} micro-batches into epoch "
                f"{self.epoch}, which {num_processes} processes cannot split evenly: resume at a "
                "world size whose global batch (processes x gradient accumulation) is the same"
            )
        return self.global_batches_in_epoch // num_processes


def build_model(args: argparse.Namespace):
    if args.model_name_or_path:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(64, args.seq_len),
        )
    )


def build_synthetic_dataset(num_samples: int, seq_len: int, vocab_size: int, seed: int):
    """Arithmetic progressions modulo the vocabulary, each with its own stride (1, 2 or 3): the
    next token follows from the previous two, so the loss falls fast from log(vocab_size)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
    strides = torch.randint(1, 4, (num_samples, 1), generator=generator)
    positions = torch.arange(seq_len).unsqueeze(0)
    input_ids = (starts + strides * positions) % vocab_size
    return Dataset.from_dict({"input_ids": input_ids.tolist()})


def build_text_dataset(args: argparse.Namespace, accelerator: Accelerator):
    """Tokenize a real dataset and pack it into blocks of --seq-len tokens (no padding)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    raw = load_dataset(args.dataset, args.dataset_config, split=args.dataset_split)

    def tokenize(batch):
        return tokenizer(batch[args.text_column])

    def pack(batch):
        ids = [token for row in batch["input_ids"] for token in row]
        usable = len(ids) // args.seq_len * args.seq_len
        return {"input_ids": [ids[i:i + args.seq_len] for i in range(0, usable, args.seq_len)]}

    # The main process tokenizes first and fills the cache; the others then read it.
    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        packed = tokenized.map(pack, batched=True, remove_columns=tokenized.column_names)
    return packed


def collate(rows):
    input_ids = torch.tensor([row["input_ids"] for row in rows], dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def param_checksum(accelerator: Accelerator, model) -> float:
    """The sum of every parameter, the same on all ranks when they hold the same model. Sharded
    models (FSDP, DeepSpeed) are gathered first and rank 0's sum is shared with the others."""
    if getattr(model, "zero_optimization_stage", lambda: 0)() == 3:
        # DeepSpeed's ZeRO-3 engine: get_state_dict would need stage3_gather_16bit_weights_on_
        # model_save in the JSON, so gather the partitions here (a collective too).
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return sum(p.detach().double().sum().item() for p in model.parameters())
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        state = accelerator.get_state_dict(model)  # a collective: every rank calls it
        total = [sum(t.double().sum().item() for t in (state or {}).values()
                     if torch.is_floating_point(t))]
        broadcast_object_list(total, from_process=0)
        return total[0]
    return sum(p.detach().double().sum().item() for p in model.parameters())


def emit(line: str) -> None:
    """Write one whole log line in a single write: the processes of a machine share one stdout,
    and `print` (two writes when PYTHONUNBUFFERED is set) could interleave their lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_main(accelerator: Accelerator, line: str) -> None:
    """Print on global rank 0 only. `accelerator.print` prints on the local main process of every
    machine, so a 2-node job would log each STEP line twice."""
    if accelerator.is_main_process:
        emit(line)


def step_pace(args: argparse.Namespace) -> float:
    """Seconds to sleep after each optimizer step in this attempt: --sleep-per-step, or none from
    attempt --sleep-until-attempt on."""
    attempt = int(os.environ.get("ACCELERATE_JOB_ATTEMPT", "0"))
    if args.sleep_until_attempt is not None and attempt >= args.sleep_until_attempt:
        return 0.0
    return args.sleep_per_step


def maybe_fail(args: argparse.Namespace, accelerator: Accelerator, step: int) -> None:
    """Crash (no cleanup, like a killed process) or hang on purpose, to test restarts."""
    if step not in (args.fail_at_step, args.hang_at_step) or (
            accelerator.process_index != args.fail_rank):
        return
    attempt = os.environ.get("ACCELERATE_JOB_ATTEMPT", "0")
    if args.fail_attempt is not None and int(attempt) != args.fail_attempt:
        return
    marker = os.environ.get(FAIL_ONCE_MARKER_ENV)
    if marker:
        if Path(marker).exists():
            return
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(f"rank {accelerator.process_index} failed at step {step}\n")
    if step == args.hang_at_step:
        emit(f"HANGING rank={accelerator.process_index} step={step}")
        while True:  # a signal handler (stop_on_signal) returns here: keep hanging
            time.sleep(3600)
    emit(f"FAILING on purpose rank={accelerator.process_index} step={step}")
    sys.stderr.flush()
    os._exit(1)



def describe_setup(accelerator: Accelerator) -> str:
    """What accelerate really set up, from its own state: the config the pod asked for may
    quietly turn into something else (DeepSpeed or FSDP without GPUs, FSDP on one process)."""
    state = accelerator.state
    text = (f"SETUP distributed_type={state.distributed_type.value} "
            f"mixed_precision={state.mixed_precision}")
    if getattr(state, "deepspeed_plugin", None) is not None:
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        offload = (zero.get("offload_optimizer") or {}).get("device", "none")
        text += f" zero_stage={zero.get('stage')} offload_optimizer={offload}"
    if getattr(state, "fsdp_plugin", None) is not None:
        text += f" fsdp_sharding={state.fsdp_plugin.sharding_strategy}"
    return text

def process_group_kwargs() -> list:
    """DeepSpeed on a machine without GPUs: accelerate picks no backend for it, so every rank
    would believe it is alone. gloo is the one that works (docs/deepspeed-on-cpu.md); on GPUs
    accelerate's own choice (nccl) stays."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo")]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    accelerator = Accelerator(
        kwargs_handlers=process_group_kwargs(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        project_config=ProjectConfiguration(
            project_dir=args.checkpoint_dir,
            automatic_checkpoint_naming=True,
            total_limit=args.checkpoints_to_keep,
        ),
        # The data order depends only on the seed and the epoch, so a resumed run sees the same
        # batches as an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # The scheduler steps once per optimizer step (below), whatever the world size: its
        # saved position means the same step when a run resumes with fewer or more processes.
        step_scheduler_with_optimizer=False,
        log_with=args.report_to,
    )
    # Every rank says where it is: a world size of 1 here means the job silently did not
    # distribute (see the trainer's checks).
    emit(
        f"RANK_INFO rank={accelerator.process_index} local_rank={accelerator.local_process_index} "
        f"world_size={accelerator.num_processes} node_rank={os.environ.get('NODE_RANK', '0')}"
    )
    try:  # the distributed_type and world size the trainer launched, or fail in every rank
        check_accelerator(accelerator)
    except DistributedMismatch as error:
        raise SystemExit(f"error: {error}") from None
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps:
        # accelerate lets $ACCELERATE_GRADIENT_ACCUMULATION_STEPS win over the value passed to
        # Accelerator(): the operator sets it on an elastic job (raised at a reduced size, so the
        # global batch stays), the launcher from a DeepSpeed config's gradient_accumulation_steps.
        print_main(
            accelerator,
            f"NOTE gradient_accumulation_steps={accelerator.gradient_accumulation_steps} "
            f"(ACCELERATE_GRADIENT_ACCUMULATION_STEPS or the DeepSpeed config) overrides "
            f"--gradient-accumulation-steps {args.gradient_accumulation_steps}",
        )
    set_seed(args.seed)

    model = build_model(args)
    if args.dataset:
        dataset = build_text_dataset(args, accelerator)
    else:
        dataset = build_synthetic_dataset(
            args.num_samples, args.seq_len, model.config.vocab_size, args.seed
        )
    dataloader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate, drop_last=True
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    # Counted in optimizer steps: stepped once per optimizer step (step_scheduler_with_optimizer
    # is off), not once per process as accelerate would by default.
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=args.warmup_steps,
        num_training_steps=args.max_steps,
    )
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        model, optimizer, dataloader, scheduler
    )
    print_main(accelerator, describe_setup(accelerator))
    if len(dataloader) == 0:
        raise SystemExit(
            f"the dataset has {len(dataset)} samples: too few for batch size {args.batch_size} on "
            f"{accelerator.num_processes} processes"
        )
    state = TrainingState()
    accelerator.register_for_checkpointing(state)
    if args.report_to:
        accelerator.init_trackers("accelerate-job", config=vars(args))

    # Also moves the checkpoint counter past any folder already there (a half-written one
    # included), so the next save cannot collide with it.
    if args.resume_from == "latest":
        latest = find_resume_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
        args.resume_from = str(latest) if latest else None
    if resume_from_checkpoint(accelerator, args.resume_from):
        print_main(accelerator, f"RESUMED from={args.resume_from} step={state.step}")
    if args.checkpoint_dir:
        # SIGTERM (a drain, a preemption, the group being stopped) becomes a request that
        # checkpoint_on_stop answers at the next step boundary, on every rank together.
        stop_on_signal()

    global_batch = (
        args.batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes
    )
    first_loss = last_loss = None
    pace = step_pace(args)
    started, steps_this_run = time.perf_counter(), 0
    accumulated_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    model.train()
    while state.step < args.max_steps:
        dataloader.set_epoch(state.epoch)
        skip = state.batches_to_skip(accelerator.num_processes)
        batches = accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad()
            state.global_batches_in_epoch += accelerator.num_processes
            accumulated_loss += loss.detach().float()
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue

            state.step += 1
            steps_this_run += 1
            maybe_fail(args, accelerator, state.step)
            if state.step == 1 or state.step % args.log_every == 0 or state.step == args.max_steps:
                # A collective: every rank reaches it at the same steps.
                step_loss = accelerator.reduce(accumulated_loss / micro_batches, "mean").item()
                first_loss = step_loss if first_loss is None else first_loss
                last_loss = step_loss
                print_main(
                    accelerator,
                    f"STEP step={state.step} loss={step_loss:.6f} epoch={state.epoch}",
                )
                accelerator.log(
                    {"loss": step_loss, "lr": scheduler.get_last_lr()[0], "epoch": state.epoch},
                    step=state.step,
                )
                if progress_reporter is not None and accelerator.is_main_process:
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    progress_reporter.report(
                        step=state.step,
                        total_steps=args.max_steps,
                        epoch=state.epoch,
                        loss=step_loss,
                        samples_per_second=steps_this_run * global_batch / elapsed,
                    )
            accumulated_loss.zero_()
            micro_batches = 0
            if args.checkpoint_every and state.step % args.checkpoint_every == 0:
                save_checkpoint(accelerator)
            if args.checkpoint_dir and state.step < args.max_steps:
                # A collective: when any rank was told to stop, all save this step and exit 83.
                checkpoint_on_stop(accelerator)
            if pace:
                time.sleep(pace)
            if state.step >= args.max_steps:
                break
        else:  # the epoch ran out before max_steps
            state.epoch += 1
            state.global_batches_in_epoch = 0

    if args.report_shards and accelerator.distributed_type == DistributedType.DEEPSPEED:
        from zero_shards import report_shards  # beside this script (in the image too)

        report_shards(accelerator, model, emit)
    checksum = param_checksum(accelerator, model)
    emit(f"FINAL rank={accelerator.process_index} param_checksum={checksum:.8f} steps={state.step}")
    print_main(
        accelerator,
        f"TRAINING_DONE steps={state.step} first_loss={_fmt(first_loss)} "
        f"last_loss={_fmt(last_loss)}",
    )
    time.sleep(args.quiet_end)
    # Without these, gloo can abort at interpreter exit ("terminate called without an active
    # exception") and turn a finished run into exit code 1.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


def _fmt(loss: float | None) -> str:
    return "nan" if loss is None or math.isnan(loss) else f"{loss:.6f}"


if __name__ == "__main__":
    sys.exit(main())
