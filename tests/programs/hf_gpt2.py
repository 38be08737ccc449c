"""A tiny GPT-2 from Hugging Face transformers: trains a few steps, generates (greedy, sampled, and
beam search under inference mode, as pipelines run it), then saves itself with `save_pretrained`
(safetensors, which finds the tied embedding and output weights by their storage) and loads the
files again on the CPU.

Built from a small GPT2Config (nothing is downloaded). Prints every loss, a checksum of the
weights, the generated tokens and the saved files' tensors, so that any bit of difference shows.
"""

import argparse
import tempfile

import torch
from _common import checksum
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
logging.set_verbosity_error()

torch.manual_seed(0)
config = GPT2Config(
    vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1
)
model = GPT2LMHeadModel(config).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = torch.randint(2, config.vocab_size, (8, 17))
for step in range(args.steps):
    batch = data.to(args.device)
    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item()!r}")
print("weights", checksum(model))

model.eval()
prompt = data[:2, :4].to(args.device)
greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
print("greedy", greedy.tolist())
torch.manual_seed(1)
sampled = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
print("sampled", sampled.tolist())
with torch.inference_mode():
    mask = torch.ones_like(prompt)
    mask[1, :1] = 0  # a left-padded prompt
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=5, num_beams=3, pad_token_id=0)
print("beams", beams.tolist())
print("final", checksum(model))

with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    loaded = GPT2LMHeadModel.from_pretrained(folder)
print("saved", loaded.transformer.wte.weight is loaded.lm_head.weight, checksum(loaded))
