"""Transformer layers and attention in inference (eval, no gradients), where torch takes its fused
fast paths on the CPU and on GPUs (an encoder given a padding mask packs its batch into a nested
tensor); then the same modules trained, on the ordinary path. Every output is printed as a digest
of its bytes, so one differing bit shows."""

import hashlib
import sys

import torch
from torch import nn

device = sys.argv[1]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).to(device)
encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).to(device)
unnested = nn.TransformerEncoder(
    nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, activation="gelu"), 2, enable_nested_tensor=False
).to(device)
normed = nn.TransformerEncoder(
    nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, activation="gelu"), 3, norm=nn.LayerNorm(16)
).to(device)
attention = nn.MultiheadAttention(16, 2, batch_first=True).to(device)
x = torch.randn(3, 5, 16, device=device)
padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]], device=device)
modules = (layer, encoder, unnested, normed, attention)
for module in modules:
    module.eval()
with torch.no_grad():
    print("layer", digest(layer(x)))
    print("layer padded", digest(layer(x, src_key_padding_mask=padding)))
    print("encoder", digest(encoder(x)))
    print("encoder unnested padded", digest(unnested(x, src_key_padding_mask=padding)))
    print("encoder padded", digest(encoder(x, src_key_padding_mask=padding)))
    print("encoder gelu norm padded", digest(normed(x, src_key_padding_mask=padding)))
    print("encoder padded on the left", digest(encoder(x, src_key_padding_mask=padding.flip(1))))
    packed = torch._nested_tensor_from_mask(x, padding.logical_not())
    print("packed", digest(packed.to_padded_tensor(0.0)), digest(packed.to_padded_tensor(-1.0, (3, 6, 16))))
    out, weights = attention(x, x, x)
    print("attention", digest(out), digest(weights))
    out, _ = attention(x, x, x, key_padding_mask=padding, need_weights=False)
    print("attention padded", digest(out))
with torch.inference_mode():
    print("layer inference mode", digest(layer(x)))
    print("encoder padded inference mode", digest(normed(x, src_key_padding_mask=padding)))
for module in modules:
    module.train()
loss = layer(x).square().mean() + encoder(x).square().mean() + attention(x, x, x)[0].square().mean()
loss.backward()
print("trained", digest(loss), digest(layer.linear1.weight.grad), digest(attention.in_proj_weight.grad))
