"""An ordinary `transformers.Trainer` script, with no progress code of ours: in an AccelerateJob,
PROGRESS, ETA and its latest metrics still reach `kubectl get ajob`, because transformers'
KubeflowCallback reports to the operator's endpoint, which the operator points it at on pod 0
(KUBEFLOW_TRAINER_SERVER_URL; docs/progress-logs-cli.md).

It trains a tiny Llama built from a config (no download) on a synthetic, learnable sequence task,
so it runs anywhere, CPU included: `accelerate launch examples/trainer_example.py --max-steps 50`.
The trainer image ships it as /opt/accelerate/examples/trainer_example.py.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up modulo the vocabulary: a task a tiny model learns in few steps."""

    def __init__(self, size: int, seq_len: int, vocab_size: int):
        self.size, self.seq_len, self.vocab_size = size, seq_len, vocab_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.seq_len) + index) % self.vocab_size
        return {"input_ids": ids, "labels": ids.clone()}


class Pace(TrainerCallback):
    """`--sleep-per-step`: a run that lasts long enough to watch, without keeping CPUs busy."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="per device")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="/tmp/trainer-example")
    parser.add_argument("--sleep-per-step", type=float, default=0.0,
                        help="seconds to wait after each step (a demo slowed down to watch)")
    args = parser.parse_args(argv)

    set_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    dataset = CountingDataset(args.max_steps * args.batch_size, args.seq_len, config.vocab_size)
    callbacks = [Pace(args.sleep_per_step)] if args.sleep_per_step > 0 else []
    Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=callbacks).train()


if __name__ == "__main__":
    main()
