"""Does a program's trace count depend on what ran before in the process?

    python bench/trace_history.py

A word language model as in PyTorch's examples (2-layer LSTM, batches of 35x20 tokens, the
hidden state carried and detached, gradient clipping, a manual SGD update with a learning rate
annealed per epoch, an eval pass between epochs), trained for 3 epochs of 12 batches under
coexec through one ``with`` line, in three situations: first in the process; after an eager run
of the same model; after a coexec run of another instance through the same line. Prints the
traces, co-executed steps and fallbacks of each run's program.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import coexec  # noqa: E402

VOCAB, BPTT, BATCH = 200, 35, 20


class WordLM(nn.Module):
    def __init__(self, ninp: int = 32, nhid: int = 32, nlayers: int = 2) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=0.2)
        self.decoder = nn.Linear(nhid, VOCAB)
        self.shape = (nlayers, BATCH, nhid)

    def forward(self, x: torch.Tensor, hidden: tuple) -> tuple[torch.Tensor, tuple]:
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return F.log_softmax(self.decoder(self.drop(out)).view(-1, VOCAB), dim=1), hidden

    def init_hidden(self) -> tuple:
        return (torch.zeros(self.shape), torch.zeros(self.shape))


def train(use_coexec: bool) -> coexec.TapeStats | None:
    torch.manual_seed(1)
    model = WordLM()
    data = torch.randint(0, VOCAB, (BPTT * 12 + 1, BATCH))
    lr = 20.0
    tape = coexec.GradientTape(backend="interpret") if use_coexec else None
    for epoch in range(3):
        hidden = model.init_hidden()
        for i in range(0, BPTT * 12, BPTT):
            x, y = data[i : i + BPTT], data[i + 1 : i + 1 + BPTT].reshape(-1)
            hidden = tuple(h.detach() for h in hidden)
            if tape is None:
                hidden = step(model, x, y, hidden, lr)
            else:
                with tape:
                    hidden = step(model, x, y, hidden, lr)
        model.eval()
        with torch.no_grad():
            model(data[:BPTT], model.init_hidden())
        model.train()
        lr /= 4
    return tape.stats if tape is not None else None


def step(model: WordLM, x: torch.Tensor, y: torch.Tensor, hidden: tuple, lr: float) -> tuple:
    model.zero_grad()
    out, hidden = model(x, hidden)
    F.nll_loss(out, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    return hidden


def run(before: str) -> None:
    if before == "eager":
        train(False)
    elif before == "coexec":
        train(True)
    s = train(True)
    print(f"{'after ' + before if before != 'nothing' else 'alone':<14} traces {s.traces}  "
          f"co-executed {s.coexec_steps}/{s.steps}  fallbacks {s.fallbacks}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:  # each situation in a fresh process
        for before in ("nothing", "eager", "coexec"):
            subprocess.run([sys.executable, __file__, before], check=True)
