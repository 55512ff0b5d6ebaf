"""Greedy picks from a vocabulary head without streaming all of it (screen.c).

Greedy decoding only needs each row's argmax over the vocabulary, yet the head is a large share of
the weights a token streams (SmolLM2: 113 MB of 538 in fp32, 21%). `GreedyScreen` keeps a w8a8 copy
of the head (Q8_0 weights and int8-rounded activations: a quarter of fp32's bytes, and int8 dot
products where many rows make the product compute-bound) and, per row, a rigorous bound on how far
each of its outputs can be from the full head's (screen.c's header). Every column the bound cannot
rule out is computed exactly, with the full kernel's own arithmetic, so the pick is the one the full
head gives, bit for bit, ties included. On SmolLM2 (1898 rows of plain and speculative decoding,
8 benchmark prompts, fp32) a row kept 2 columns (median), 7 (p90), 50 at most. Rows where more than
`CAP` columns pass, or any value is not finite, are computed in full; so are products of more than
`MAX_ROWS_WITHOUT_VNNI` rows on a CPU without VNNI.

The screened rows hold the candidates' exact logits and -inf elsewhere: only an argmax may read
them (the engine asks for them only for greedy sequences' rows, MTP and draft-model drafters for
their greedy chains' draft rows). `SPECPACK_GREEDY_SCREEN=0` turns it off.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from specpack.runtime.kernels._lib import _library
from specpack.runtime.kernels.linear import FORMATS, NR, PackedLinear, pack_w8a8, panel_layout, q8_values, unpack
from specpack.runtime.kernels.tuning import of_panels

CAP = 256  # candidates per row before the row is computed in full (screen.c keeps at most 256)
SCREENED = ("fp32", "fp16", "bf16", "int8")  # the head's formats screen.c recomputes columns of
# Rows per call the screen takes where the CPU has no VNNI (its w8a8 pass runs AVX2 integer tiles, about
# int8's speed: a decode step's rows); with VNNI any number (64 rows of SmolLM2's fp32 head: 13.1 -> 5.4 ms)
MAX_ROWS_WITHOUT_VNNI = 32
CHUNK = 1024  # head rows per step of the w8a8 copy and its bounds (float64 temporaries: ~25 MiB on a 576-wide head)


def enabled() -> bool:
    return os.environ.get("SPECPACK_GREEDY_SCREEN", "1").strip() != "0"


class GreedyScreen:
    """The w8a8 copy of a packed head and its per-output bounds; `logits(x, greedy)` is the head's
    product with the rows of `greedy` screened."""

    def __init__(self, head: PackedLinear):
        self.head = head
        self.cheap, self.bounds = _cheap_pass(head)  # the w8a8 copy; [2, V]: e_v, m_v
        self._fn = _library()[0].sp_screen
        self.max_rows = None if _library()[0].sp_vnni() else MAX_ROWS_WITHOUT_VNNI

    @classmethod
    def of(cls, head) -> "GreedyScreen | None":
        """A screen for `head` (a PackedLinear, or a module holding one as `.packed`), or None where
        it has none to offer: screen or kernels off (the head on torch's fallback), a head kept in
        w8a8 (it is the cheap pass), or a bias."""
        packed = getattr(head, "packed", head)
        if (not enabled() or not isinstance(packed, PackedLinear)
                or packed.backend != "avx2" or packed.weights not in SCREENED or packed.bias is not None):
            return None
        return cls(packed)

    def logits(self, x: Tensor, greedy: Sequence[int]) -> Tensor:
        """x [R, K] (fp32) times the head: [R, V], the rows listed in `greedy` screened (their
        argmax is the full product's; see the module docstring), the others in full."""
        R = len(x)
        greedy = sorted(set(greedy))
        if greedy and not 0 <= greedy[0] <= greedy[-1] < R:
            raise IndexError(f"greedy rows {greedy[0]}..{greedy[-1]} outside the {R} rows given")
        if not greedy or (self.max_rows is not None and len(greedy) > self.max_rows):
            return self.head(x)
        x = x.contiguous()
        if len(greedy) == R:  # the usual step: every row greedy, screened in place
            return self._screen(x, self.cheap(x))
        out = torch.empty(R, self.head.out_features)
        screened = torch.zeros(R, dtype=torch.bool)
        screened[greedy] = True
        out[~screened] = self.head(x[~screened].contiguous())
        xs = x[screened].contiguous()
        out[screened] = self._screen(xs, self.cheap(xs))
        return out

    def _screen(self, x: Tensor, y: Tensor) -> Tensor:
        """Screen y = the cheap pass over x, in place; rows it cannot decide get the full head's
        values."""
        count = torch.empty(len(x), dtype=torch.int64)
        self._fn(x.data_ptr(), len(x), x.shape[1], x.stride(0), y.data_ptr(), y.shape[1], y.stride(0),
                 self.bounds.data_ptr(), self.head.weight.data_ptr(), FORMATS[self.head.weights], CAP,
                 count.data_ptr(), self.head.threads)
        undecided = (count < 0).nonzero()[:, 0]
        if len(undecided):
            y[undecided] = self.head(x[undecided].contiguous())
        return y


def _cheap_pass(head: PackedLinear) -> tuple[PackedLinear, Tensor]:
    """The head's w8a8 copy (what `pack(dense, weights="w8a8")` makes of the values the head multiplies by, bit for
    bit) and its bounds, made CHUNK rows at a time: never the whole fp32 head beside its panels."""
    V, K = head.out_features, head.in_features
    shape, dtype = panel_layout("w8a8", V, K)
    panels = torch.empty(shape, dtype=dtype)
    bounds = torch.empty(2, V, dtype=torch.float32)
    for a in range(0, V, CHUNK):
        b = min(V, a + CHUNK)
        dense = unpack(head.weight[a // NR: -(-b // NR)], head.weights, b - a, K)  # [b - a, K]
        panels[a // NR: -(-b // NR)] = pack_w8a8(dense)
        bounds[:, a:b] = _bounds(dense, panels[a // NR: -(-b // NR)])
    return of_panels(panels, "w8a8", (V, K), threads=head.threads), bounds


def _bounds(dense: Tensor, panels: Tensor) -> Tensor:
    """[2, N] fp32 for dense [N, K] and its w8a8 panels: per output v, e_v = ||W_v - Q_v|| and m_v = ||W_v||, from
    float64 and rounded up (never below the exact value)."""
    N, K = dense.shape
    q, scales = q8_values(panels, "w8a8")  # [N', B, 32], [N', B]
    w = dense.double()
    qv = (q[:N].double() * scales[:N].double()[..., None]).reshape(N, -1)[:, :K]
    out = torch.stack([(w - qv).norm(dim=1), w.norm(dim=1)])
    up = out.float()
    return torch.where(up.double() < out, torch.nextafter(up, torch.tensor(float("inf"))), up)
