"""A small model for the optimizer-in-backward tests, CPU and GPU alike."""

import torch
from torch import nn


class TiedNet(nn.Module):
    """An embedding tied to the output head (its gradient has two contributions, merged into
    one reduce-scatter: [Note: merging reduce-scatters]) around a few residual blocks."""

    def __init__(self, vocab: int = 61, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h @ self.embed.weight.t()
