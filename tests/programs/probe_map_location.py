"""Checkpoints loaded with a callable `map_location`, as older training code does
(`lambda storage, loc: storage.cuda(gpu)`): each tensor lands where the callable sends its storage,
with its values. Run on a device (`cuda`): prints where each loaded tensor is."""

import io

import torch

torch.manual_seed(0)
saved = io.BytesIO()
model = torch.nn.Linear(3, 2).cuda()
torch.save({"model": model.state_dict(), "host": torch.arange(4.0), "step": 7}, saved)
expected = [model.weight.tolist(), model.bias.tolist(), [0.0, 1.0, 2.0, 3.0]]


def load(map_location):
    saved.seek(0)
    loaded = torch.load(saved, map_location=map_location)
    tensors = [loaded["model"]["weight"], loaded["model"]["bias"], loaded["host"]]
    places = [str(tensor.device) for tensor in tensors]
    return places, [tensor.tolist() for tensor in tensors] == expected, loaded["step"]


print("cuda()", *load(lambda storage, loc: storage.cuda()))
print("cuda(1)", *load(lambda storage, loc: storage.cuda(1)))
print("to cuda:1", *load(lambda storage, loc: storage.to("cuda:1")))
print("host", *load(lambda storage, loc: storage))
print("cpu()", *load(lambda storage, loc: storage.cpu()))
print("as saved", *load(lambda storage, loc: None))
print("by torch", *load(lambda storage, loc: torch.serialization.default_restore_location(storage, "cuda:1")))
layer = torch.nn.Linear(3, 2).cuda()
saved.seek(0)
layer.load_state_dict(torch.load(saved, map_location=lambda storage, loc: storage.cuda(0))["model"])
print("loaded into a model", layer.weight.device, torch.equal(layer.weight, model.weight))
