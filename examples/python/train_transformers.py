"""A transformers Llama, trained on the CPU with attn_implementation="attnkit": two documents
packed into each row (position_ids restart at each), each document two random tokens repeated
(a b a b ...), so a query must look two tokens back (docs/python.md). Exits 1 unless the loss
falls; exits 0 with a line saying so where transformers is not installed (the Debian legs)."""

import sys

import torch

try:
    import transformers
except ImportError:
    print("transformers is not installed: nothing to train")
    sys.exit(0)

import attnkit.transformers

# [doc:train]
attnkit.transformers.register()  # attn_implementation="attnkit"
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


def packed_batch(rows=4, lengths=(48, 80)):
    """Rows of two documents, each two random tokens repeated; position_ids restart at each
    document, which transformers turns into a document mask."""
    tokens, positions = [], []
    for _ in range(rows):
        row = []
        for length in lengths:
            row.append(torch.randint(0, 32, (2,)).repeat(length // 2))
        tokens.append(torch.cat(row))
        positions.append(torch.cat([torch.arange(length) for length in lengths]))
    return torch.stack(tokens), torch.stack(positions)


losses = []
for step in range(60):
    input_ids, position_ids = packed_batch()
    # use_cache=False: a training step (transformers finds packed documents only without one)
    loss = model(input_ids=input_ids, position_ids=position_ids, labels=input_ids,
                 use_cache=False).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f}")
# [doc:end]

sys.exit(0 if sum(losses[-10:]) / 10 < 0.8 * losses[0] else 1)
