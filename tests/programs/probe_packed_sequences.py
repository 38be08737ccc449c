"""Recurrent networks over packed sequences (pack_padded_sequence, pack_sequence and back), as
NLP programs feed them: where the batch sizes and lengths live, the values, gradients and errors."""

import sys

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence, pad_sequence

device = sys.argv[1]
torch.manual_seed(0)
rnn = nn.LSTM(3, 4, batch_first=True).to(device)
gru = nn.GRU(3, 4).to(device)
x = torch.randn(3, 5, 3, device=device)
lengths = torch.tensor([5, 2, 4])
packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
print("packed", packed.batch_sizes.device.type, packed.batch_sizes.tolist(), packed.data.shape)
out, (h, c) = rnn(packed)
padded, out_lengths = pad_packed_sequence(out, batch_first=True)
print(
    "padded",
    tuple(padded.shape),
    out_lengths.device.type,
    out_lengths.tolist(),
    round(padded.sum().item(), 5),
)
padded.sum().backward()
print("grad", round(rnn.weight_ih_l0.grad.sum().item(), 5))
seqs = [torch.randn(n, 3, device=device) for n in (4, 3, 1)]
out2, h2 = gru(pack_sequence(seqs))
print("gru", round(h2.sum().item(), 5), tuple(pad_sequence(seqs).shape))
total, lens = pad_packed_sequence(out2, total_length=6)
print("total_length", tuple(total.shape), lens.tolist())
try:
    pack_padded_sequence(x, torch.tensor([2, 5, 4]), batch_first=True)
except RuntimeError as e:
    print("unsorted", str(e)[:80])
