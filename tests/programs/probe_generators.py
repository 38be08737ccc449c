"""Generators made for the device (`torch.Generator(device="cuda")`, as samplers and diffusion
pipelines make them): they name the device, draw the numbers a direct run's generator draws,
replay a saved state, and survive copies and pickles."""

import copy
import pickle
import sys

import torch

device = sys.argv[1]
generator = torch.Generator(device=device)
print(
    "device",
    generator.device == torch.device(device, 0) if device == "cuda" else generator.device.type == device,
    isinstance(generator, torch.Generator),
    isinstance(torch.default_generator, torch.Generator),
)
generator.manual_seed(5)
print("randn", torch.randn(3, device=device, generator=generator).tolist())
print("randperm", torch.randperm(6, device=device, generator=generator).tolist())
print("rand_", torch.empty(3, device=device).uniform_(generator=generator).tolist())
print("normal", torch.normal(torch.zeros(3, device=device), 1.0, generator=generator).tolist())
print("multinomial", torch.multinomial(torch.ones(5, device=device), 3, generator=generator).tolist())
state = generator.get_state()
drawn = torch.rand(2, device=device, generator=generator).tolist()
generator.set_state(state)
print("replay", drawn == torch.rand(2, device=device, generator=generator).tolist(), generator.initial_seed())
copied = copy.deepcopy(generator)
print(
    "deepcopy",
    copied.device == generator.device,
    torch.rand(2, device=device, generator=copied).tolist()
    == torch.rand(2, device=device, generator=generator).tolist(),
)
plain = torch.Generator()
print("plain", plain.device.type, type(plain).__name__)
loader = torch.utils.data.DataLoader(list(range(6)), shuffle=True, generator=torch.Generator().manual_seed(1))
print("loader", [b.tolist() for b in loader])
again = pickle.loads(pickle.dumps(generator))
print(
    "pickle",
    again.device == generator.device,
    torch.rand(2, device=device, generator=again).tolist()
    == torch.rand(2, device=device, generator=generator).tolist(),
)
