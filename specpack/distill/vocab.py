"""The draft vocabulary: the K target tokens the target predicts most often, and its maps.

As in EAGLE-3: `d2t[i] = ids[i] - i` (target id = draft id + d2t[draft id]) over ids sorted
ascending, and `t2d` a bool mask over the target vocab marking the ids the draft vocab holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftVocab:
    ids: Tensor  # [K] int64, sorted target ids
    target_size: int
    coverage: float  # share of the target's predictions in the data that the draft vocab holds

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def d2t(self) -> Tensor:
        return self.ids - torch.arange(self.size)

    @property
    def t2d(self) -> Tensor:
        mask = torch.zeros(self.target_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask


def build_vocab(pred: Tensor, tokens: Tensor, target_size: int, size: int) -> DraftVocab:
    """Top `size` tokens by how often the target predicts them (`pred`); ties and never-predicted
    slots are filled by how often they occur in the text (`tokens`), then by id."""
    predicted = torch.bincount(pred, minlength=target_size).double()
    seen = torch.bincount(tokens, minlength=target_size).double()
    # lexicographic (predicted, seen, -id) as one score, exact in float64 for realistic counts
    score = predicted * (seen.max() + 1) + seen - torch.arange(target_size, dtype=torch.float64) / (target_size + 1)
    ids = score.topk(size).indices.sort().values
    coverage = float(predicted[ids].sum() / max(predicted.sum(), 1))
    return DraftVocab(ids=ids, target_size=target_size, coverage=coverage)
