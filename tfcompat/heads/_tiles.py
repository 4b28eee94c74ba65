"""What both chunked backends of `tfcompat.heads` share: the ignored label, tile alignment and spans, the
float32 accumulation of a tile's matmul (`_accumulate_mm`), and the error of a second backward through kept
logits."""

from __future__ import annotations

import torch

from ..errors import InvalidInputError

IGNORE_INDEX = -100

# Rows and columns of every tile are multiples of this. A tile of C vocabulary columns is the leading dimension
# of its logits and of its gradient; when C is not a multiple of 8 (16 bytes of bf16) cuBLAS falls back to
# align-1 kernels, 2-3x slower. Row offsets ``r * H`` of the hidden slices are aligned for any H too.
_ALIGN = 128


def _aligned(count: int, limit: int) -> int:
    """``count`` rounded up to a multiple of `_ALIGN`, at most ``limit`` (a whole axis needs no alignment)."""
    return min(-(-count // _ALIGN) * _ALIGN, limit)


def _spans(total: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with a float32 ``out``: on CUDA cuBLAS adds the float32 product into ``out`` directly
    (``addmm(out_dtype=float32)``); elsewhere ``a @ b`` is rounded to the inputs' dtype first when lower."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += a @ b


def kept_logits_consumed() -> InvalidInputError:
    """The error of a second backward through a head that kept its logits (``keep_logits=True``)."""
    return InvalidInputError(
        "keep_logits=True allows one backward per forward",
        why="the first backward wrote the gradient over the kept logits",
        fix="run the head's forward again before another backward, or pass keep_logits=False",
    )
