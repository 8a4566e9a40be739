"""A small model trained on the CPU with attnkit.flex_attention and a document mask: packed
sequences of random tokens, each document's second half repeating its first, so a query must
look back inside its own document (docs/python.md). Exits 1 unless the loss falls."""

import sys

import torch

import attnkit

# [doc:train]
torch.manual_seed(0)
vocab, dim, heads, n = 32, 64, 4, 256
lengths = torch.tensor([40, 64, 24, 80, 48])  # five documents packed into one row of 256
doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def same_document(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)


# Judged once, reused by every step: only the tiles that straddle a boundary are partial.
block_mask = attnkit.create_block_mask(same_document, None, None, n, n, BLOCK_SIZE=64)


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(n, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):  # (1, n) -> (1, n, vocab)
        x = self.embed(tokens) + self.position.weight
        q, k, v = self.qkv(x).view(1, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        y = attnkit.flex_attention(q, k, v, block_mask=block_mask)  # (1, heads, n, dim / heads)
        return self.out(y.transpose(1, 2).reshape(1, n, dim) + x)


def batch():
    # Each document: a random first half, then the same tokens again.
    parts = []
    for length in lengths.tolist():
        half = torch.randint(0, vocab, (length // 2,))
        parts.append(torch.cat([half, half]))
    tokens = torch.cat(parts).unsqueeze(0)
    return tokens[:, :-1], tokens[:, 1:]


model = TinyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for step in range(300):
    inputs, targets = batch()
    inputs = torch.cat([inputs, targets[:, -1:]], 1)  # n tokens in, the next of each out
    logits = model(inputs)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f}")
# [doc:end]

sys.exit(0 if sum(losses[-10:]) / 10 < 0.8 * losses[0] else 1)
