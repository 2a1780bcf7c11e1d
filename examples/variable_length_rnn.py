"""A variable-length LSTM training script: the sequence length changes every step.

    python examples/variable_length_rnn.py            # train 30 steps, eager PyTorch
    python -m tracegraph show examples/variable_length_rnn.py -n 10   # inspect its TraceGraph
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
MAX_LEN, BATCH, FEATURES, HIDDEN = 8, 4, 8, 16

cell = nn.LSTMCell(FEATURES, HIDDEN)
head = nn.Linear(HIDDEN, 1)
optimizer = torch.optim.Adam([*cell.parameters(), *head.parameters()], lr=1e-2)
batches = [(torch.randn(MAX_LEN, BATCH, FEATURES), torch.randn(BATCH, 1)) for _ in range(5)]


def train_step(i: int) -> float:
    seq, target = batches[i % len(batches)]
    length = 1 + (3 * i) % MAX_LEN  # a different length every step
    optimizer.zero_grad()
    h = torch.zeros(BATCH, HIDDEN)
    c = torch.zeros(BATCH, HIDDEN)
    for t in range(length):
        h, c = cell(seq[t], (h, c))
    loss = F.mse_loss(head(h), target)
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == "__main__":
    for i in range(30):
        loss = train_step(i)
        if i % 10 == 0:
            print(f"step {i:3d}  loss {loss:.4f}")
