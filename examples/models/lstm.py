"""An LSTM language model: embedding, a stacked nn.LSTM, a linear decoder."""

from __future__ import annotations

import torch
from torch import nn


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int, d_model: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.lstm = nn.LSTM(d_model, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(idx))
        return self.decoder(h)
