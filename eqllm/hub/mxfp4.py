"""MXFP4 (OCP Microscaling, FP4 E2M1 values with one E8M0 scale per 32) expert weights, as the
published gpt-oss checkpoints store them, dequantized exactly as transformers'
`integrations.mxfp4.convert_moe_packed_tensors` does.

A tensor `name` is stored as `name_blocks` [..., rows, groups, 16] (uint8: two 4-bit values a
byte, the low nibble first) and `name_scales` [..., rows, groups] (uint8: a power of two, biased
by 127). Each row holds groups * 32 values; the dequantized tensor is transposed to [..., groups
* 32, rows], the layout of the unquantized tensor (gpt-oss's experts: x @ W).
"""

from __future__ import annotations

import numpy as np

from eqllm.hub.files import CheckpointError

# The 16 values of a 4-bit E2M1 code (sign bit first), the table transformers uses.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """float32 [..., groups * 32, rows] from MXFP4 `blocks` [..., rows, groups, 16] and
    `scales` [..., rows, groups] (see the module docstring). Every value is exact in float32
    (and in bfloat16, which transformers computes in)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(
            f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not "
            "fit ([..., rows, groups, 16] and [..., rows, groups])"
        )
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32) - 127
    values = np.ldexp(values, exponents[..., None])
    values = values.reshape(*blocks.shape[:-2], -1)  # [..., rows, groups * 32]
    return np.swapaxes(values, -1, -2)
