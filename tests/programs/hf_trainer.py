"""Hugging Face transformers' Trainer on a small GPT-2 (from a config, nothing downloaded), as a
user writes it: launched torchrun-style, the Trainer runs DDP over the ranks it finds, with a
DataLoader worker, gradient accumulation, an evaluation and a save (`checkpoint-N`, safetensors
and optimizer) every few steps. Every rank prints what the Trainer logs at each step and, at the
end, a checksum of its weights. With --hold FILE every rank waits at its last step until FILE
exists (a test's signal to end).
"""

import argparse
import os
import time

import torch
from _common import checksum
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="the Trainer's output folder")
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--hold", help="at the last step, wait until this file exists")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
args = parser.parse_args()
logging.set_verbosity_error()
rank = int(os.environ.get("RANK", "0"))


class Tokens(torch.utils.data.Dataset):
    """Seeded random token sequences, each its own label."""

    def __init__(self, count: int) -> None:
        self.data = torch.randint(0, 256, (count, 32), generator=torch.Generator().manual_seed(count))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index], "labels": self.data[index]}


class Report(TrainerCallback):
    """Print what the Trainer logs, on every rank (but its timings); pace the steps; hold at the last one."""

    def on_log(self, _args, state, control, logs=None, **kwargs):
        timeless = {
            key: value for key, value in logs.items() if "runtime" not in key and "per_second" not in key
        }
        shown = {
            key: (f"{value:.10f}" if isinstance(value, float) else value)
            for key, value in sorted(timeless.items())
        }
        print(f"rank {rank} step {state.global_step} {shown}", flush=True)

    def on_step_end(self, _args, state, control, **kwargs):
        if args.sleep:
            time.sleep(args.sleep)
        while state.global_step == args.steps and args.hold and not os.path.exists(args.hold):
            time.sleep(0.05)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=8,
    save_strategy="steps",
    save_steps=8,
    per_device_eval_batch_size=8,
    dataloader_num_workers=1,
    report_to=[],
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(
    model=model, args=training, train_dataset=Tokens(512), eval_dataset=Tokens(64), callbacks=[Report()]
)
trainer.train()
print(f"rank {rank} final {checksum(trainer.model)}", flush=True)
