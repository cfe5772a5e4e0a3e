"""Dequantization of a quantized block, in numpy, by the contract of kernels/quantize.h (the
same arithmetic as kernels/quantize_ref.cc, so a same-host read gives the bytes ReadKv gives).

Quantized block layout, in bytes:
  [K codes: B x code_row][V codes: B x code_row] (each plane padded to 16 bytes)
  [K scales][V scales] (float32)
  int8: code_row = D, int8 codes; scales [D] per plane; x = q * s[c]
  int4: code_row = ceil(D/2), low nibble = even channel, code q + 8; scales [D]; x = q * s[c]
  nf4:  code_row = ceil(D/2), nibble indexes NF4_CODES; scales [B][ceil(D/64)] per plane;
        x = NF4_CODES[q] * s[t, c // 64]
"""
from __future__ import annotations

import numpy as np

from kvmem.layout import DType, Precision, float32_to_bf16

NF4_CODES = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)


class QuantGeometry:
    """Where a quantized block's codes and scales lie (kernels/quantize.h QuantGeometry)."""

    def __init__(self, precision: Precision, block_tokens: int, head_dim: int) -> None:
        if precision not in (Precision.INT8, Precision.INT4, Precision.NF4):
            raise ValueError(f"precision {precision!r} is not a quantized one")
        self.precision = precision
        self.block_tokens = block_tokens
        self.head_dim = head_dim
        self.code_row = head_dim if precision is Precision.INT8 else (head_dim + 1) // 2
        self.groups = (head_dim + 63) // 64 if precision is Precision.NF4 else 0
        self.codes_bytes = (block_tokens * self.code_row + 15) // 16 * 16
        self.scale_floats = block_tokens * self.groups if precision is Precision.NF4 else head_dim
        self.k_scales_offset = 2 * self.codes_bytes
        self.v_scales_offset = self.k_scales_offset + 4 * self.scale_floats
        self.block_bytes = self.v_scales_offset + 4 * self.scale_floats


def _nibbles(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """[n][ceil(D/2)] bytes as [n][D] nibbles: channel c in byte c // 2, low nibble first."""
    out = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = rows & 0x0F
    out[:, 1::2] = rows >> 4
    return out[:, :head_dim]


def _plane(block: np.ndarray, g: QuantGeometry, codes_at: int, scales_at: int, start: int,
           count: int) -> np.ndarray:
    """Slots [start, start + count) of one plane as float32 [count][D]."""
    codes = block[codes_at:codes_at + g.block_tokens * g.code_row].reshape(g.block_tokens,
                                                                           g.code_row)
    rows = codes[start:start + count]
    scales = block[scales_at:scales_at + 4 * g.scale_floats].view("<f4")
    if g.precision is Precision.INT8:
        return rows.view(np.int8).astype(np.float32) * scales[np.newaxis, :]
    q = _nibbles(rows, g.head_dim)
    if g.precision is Precision.INT4:
        return (q.astype(np.int32) - 8).astype(np.float32) * scales[np.newaxis, :]
    per_slot = scales.reshape(g.block_tokens, g.groups)[start:start + count]
    return NF4_CODES[q] * np.repeat(per_slot, 64, axis=1)[:, :g.head_dim]


def _to_dtype(x: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.F32:
        return x.astype("<f4")
    if dtype is DType.F16:
        return x.astype("<f2")  # round to nearest even, overflow to Inf: as FloatToHalf
    return float32_to_bf16(x)


def dequantize_block(block: np.ndarray, g: QuantGeometry, start: int, count: int,
                     dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """The live slots [start, start + count) of a quantized block (uint8 bytes, the whole
    block) as K and V [count][D] in `dtype`."""
    if block.size < g.block_bytes:
        raise ValueError(f"block: {block.size} bytes, the geometry needs {g.block_bytes}")
    k = _plane(block, g, 0, g.k_scales_offset, start, count)
    v = _plane(block, g, g.codes_bytes, g.v_scales_offset, start, count)
    return _to_dtype(k, dtype), _to_dtype(v, dtype)
