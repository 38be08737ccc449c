"""Word-level LSTM language model (like pytorch/examples word_language_model)."""

import math

import torch
from _common import checksum
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(2)
ntokens, emsize, nhid, bptt, bsz = 50, 32, 32, 12, 8
g = torch.Generator().manual_seed(3)
corpus = torch.randint(0, ntokens, (bsz * bptt * 8 + 1,), generator=g)
data = corpus[:-1].view(bsz, -1).t().contiguous().to(device)
target_all = corpus[1:].view(bsz, -1).t().contiguous().to(device)


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntokens, emsize)
        self.rnn = nn.LSTM(emsize, nhid, 2, dropout=0.2)
        self.decoder = nn.Linear(nhid, ntokens)

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        emb = self.drop(self.encoder(x))
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)).view(-1, ntokens), hidden


model = RNNModel().to(device)
criterion = nn.NLLLoss()
lr = 5.0
weight = next(model.parameters())
hidden = (weight.new_zeros(2, bsz, nhid), weight.new_zeros(2, bsz, nhid))
for epoch in range(2):
    model.train()
    total = 0.0
    for i in range(0, data.size(0), bptt):
        x, y = data[i : i + bptt], target_all[i : i + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        out, hidden = model(x, hidden)
        loss = criterion(torch.log_softmax(out, dim=-1), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total += loss.item()
    print(f"epoch {epoch} loss {total:.8f} ppl {math.exp(total / 8):.4f}")
print("final", checksum(model))
