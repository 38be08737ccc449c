"""`torch.cuda.default_generators` as RNG trackers (Megatron, DeepSpeed) use it: on a proxied device
it stands for the CPU generator the device draws with, so this program, given the CPU's default
generator in a direct run, prints the same."""

import sys

import torch

device = sys.argv[1]
generators = torch.cuda.default_generators if device == "cuda" else (torch.default_generator,)
generator = generators[0]
torch.manual_seed(3)
print("device", generator.device.type == device, isinstance(generator, torch.Generator), end=" ")
print(generator.initial_seed())
state = generator.get_state()
drawn = torch.randn(4, device=device).tolist()
generator.set_state(state)
print("replay", drawn == torch.randn(4, device=device).tolist())
print("given", torch.randn(3, device=device, generator=generator).tolist())
print("then", torch.rand(2, device=device).tolist())
print("normal_", torch.empty(3, device=device).normal_(generator=generator).tolist())
print("randperm", torch.randperm(5, device=device, generator=generator).tolist())
with torch.random.fork_rng(devices=[0] if device == "cuda" else []):
    torch.randn(5, device=device)
print("after fork", torch.randn(2, device=device).tolist())
