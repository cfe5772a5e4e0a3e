"""A cache's shape and policy (kvmem.proto's Layout, DType, Precision, PolicySpec), and how
the layout dtype maps to numpy.

numpy has no bfloat16: a bf16 layout's K/V go in and come out as uint16 arrays holding the
bf16 bit patterns (bf16_to_float32 / float32_to_bf16 convert); an array whose dtype is a
2-byte `bfloat16` (ml_dtypes, as JAX uses) is accepted too.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import numpy as np


class DType(enum.IntEnum):
    """Element type of K/V (the proto's DType values)."""
    F16 = 1
    BF16 = 2
    F32 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype K/V of this type are returned as (bf16: its bits, uint16)."""
        return np.dtype({DType.F16: "<f2", DType.BF16: "<u2", DType.F32: "<f4"}[self])


class Precision(enum.IntEnum):
    """Storage precision of a block (the proto's Precision values)."""
    LAYOUT = 1  # the layout dtype, unquantized
    INT8 = 2
    INT4 = 3
    NF4 = 4


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shape of one model's cache: L layers, H KV heads, head_dim D, the element dtype, B
    tokens per block (None: the daemon's default) and the vocabulary size V."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.F16
    block_tokens: Optional[int] = None
    vocab_size: int = 0

    @property
    def streams(self) -> int:
        return self.num_layers * self.num_kv_heads

    def kv_shape(self, n: int) -> tuple[int, int, int, int]:
        """The shape of n tokens' K (or V) in an append: [L][H][n][D]."""
        return (self.num_layers, self.num_kv_heads, n, self.head_dim)


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A policy by name (None: "full") with parameter overrides; `quantization` LAYOUT never
    quantizes; `quantization_recent_tokens` None: the daemon's default (128)."""
    name: Optional[str] = None
    params: dict[str, float] = dataclasses.field(default_factory=dict)
    quantization: Precision = Precision.LAYOUT
    quantization_recent_tokens: Optional[int] = None


def kv_bytes_of(array: np.ndarray, dtype: DType, shape: tuple[int, ...], what: str) -> bytes:
    """The little-endian bytes of a K or V array that must be `shape` in `dtype`.

    The dtype must match exactly (no silent rounding of f32 into f16): a wrong one is a
    TypeError naming it, a wrong shape a ValueError.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(array).__name__}")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(array.shape)}, the layout needs {tuple(shape)} "
                         "([L][H][n][D])")
    if dtype is DType.BF16:
        ok = array.dtype.itemsize == 2 and (array.dtype.kind == "u" or
                                            array.dtype.name == "bfloat16")
    else:
        ok = array.dtype.kind == "f" and array.dtype.itemsize == dtype.itemsize
    if not ok:
        expected = "uint16 (bf16 bits) or bfloat16" if dtype is DType.BF16 else str(dtype.numpy)
        raise TypeError(f"{what}: dtype {array.dtype}, the layout's {dtype.name} needs {expected}")
    if array.dtype.name != "bfloat16" and array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).tobytes()


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32 values, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest, ties to even; NaN stays NaN), as uint16
    bits: the rule of kernels/dtype.h's FloatToBf16."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
