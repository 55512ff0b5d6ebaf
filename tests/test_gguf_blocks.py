"""families/gguf_blocks.py: llama.cpp's blocks decoded in torch, against gguf-py's numpy decoding of the
same bytes (bit for bit: both compute each value as ggml's dequantize_row_* does)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from specpack.families import gguf_blocks as gb


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Any bytes are a valid block, save a non-finite fp16 scale: random bytes with every fp16 field made a
    finite value of either sign."""
    qk, size = gb.BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // qk, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208]}[kind]
    for at in halves:
        raw[..., at:at + 2] = rng.normal(0, 0.02, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", gb.TYPES)
def test_decoding_matches_gguf_py_bit_for_bit(kind):
    rows, cols = 5, 512
    raw = random_blocks(kind, rows, cols, seed=len(kind))
    want = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    got = gb.dequantize(kind, torch.from_numpy(raw), cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_blocks_gguf_py_quantizes_decode_as_it_decodes_them(kind):
    w = np.random.default_rng(1).normal(0, 0.05, size=(16, 96)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType[kind])
    want = gguf_dequantize(raw, GGMLQuantizationType[kind])
    assert torch.equal(gb.dequantize(kind, torch.from_numpy(raw), 96), torch.from_numpy(want))
    assert np.abs(want - w).max() < 0.05 * 4 / 8  # and close to what was quantized


def test_integers_and_scales_are_what_ggml_multiplies():
    raw = torch.from_numpy(random_blocks("Q4_K", 3, 256))
    a = gb.decode("Q4_K", raw, 256)
    assert a.q.dtype == torch.uint8 and int(a.q.max()) <= 15 and a.group == 32
    assert a.scale.shape == a.min.shape == (3, 8)
    six = gb.decode("Q6_K", torch.from_numpy(random_blocks("Q6_K", 3, 256)), 256)
    assert six.q.dtype == torch.int8 and six.group == 16 and -32 <= int(six.q.min()) and int(six.q.max()) <= 31
    q4_0 = gb.decode("Q4_0", torch.from_numpy(random_blocks("Q4_0", 2, 64)), 64)
    assert torch.equal(q4_0.min, -8 * q4_0.scale)


def test_sizes_that_do_not_fill_the_shape_are_named():
    assert gb.shape_problems("w", "Q4_1", (8, 64), 8 * 40) == []
    [short] = gb.shape_problems("w", "Q4_1", (8, 64), 8 * 40 - 1)
    assert "319 bytes of Q4_1 data, but [8, 64] takes 320" in short
    [ragged] = gb.shape_problems("w", "Q4_K", (8, 64), 8 * 40)
    assert "64 columns are not whole Q4_K blocks of 256" in ragged
    [unknown] = gb.shape_problems("w", "IQ2_XS", (8, 64), 1)
    assert "IQ2_XS is not one specpack keeps quantized" in unknown


def test_decode_refuses_data_of_the_wrong_shape():
    with pytest.raises(Exception, match=r"Q8_0 data of 64 columns must be uint8 \[rows, 68\]"):
        gb.decode("Q8_0", torch.zeros(2, 67, dtype=torch.uint8), 64)
