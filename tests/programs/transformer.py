"""Small causal transformer with AdamW, dropout and a warmup LambdaLR."""

import torch
from _common import checksum
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(4)
vocab, d, seq, bs = 40, 32, 16, 8


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device)
        h = self.blocks(self.tok(idx) + self.pos[:, : idx.size(1)], mask=mask, is_causal=True)
        return self.head(self.ln(h))


model = TinyGPT().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
for step in range(12):
    batch = torch.randint(0, vocab, (bs, seq + 1))
    x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print(f"step {step} loss {loss.item():.8f} lr {sched.get_last_lr()[0]:.6f}")
print("final", checksum(model))
