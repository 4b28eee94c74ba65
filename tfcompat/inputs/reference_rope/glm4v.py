"""The reference M-RoPE index of the GLM-V families (GLM-4.1V ``glm4v``, GLM-4.5V ``glm4v_moe``, GLM-4.6V
``glm46v``), the one the installed ``get_rope_index`` is tested against.

Reference: transformers 4.57's ``Glm4vModel.get_rope_index`` with ``Glm4vProcessor``'s layout. GLM marks every
vision token with the image token; those between the video start and end tokens are video frames. The
processor writes an image as one run of ``t * h * w`` tokens (``h, w`` after the spatial merge; ``t`` is 1 for
every image it makes), and a video of grid ``(t, h, w)`` as ``t`` frames, each its own run of ``h * w`` tokens
between image start/end tokens and followed by its timestamp as text. Text tokens advance all three rows
together; an image gets ``t``/``h``/``w`` coordinates offset by the position after the preceding text, a frame
is an item of grid ``(1, h, w)`` (time lives in the timestamp text, never in the ``t`` row), and the text after
an item resumes at ``max + 1``. Padding positions are left at 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ...errors import InvalidInputError

__all__ = ["DEVIATIONS", "rope_index"]

# no release departs from the reference on attended tokens (4.53-5.24, tests/test_mrope.py)
DEVIATIONS: dict[str, str] = {}


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    deviations: tuple[str, ...] = (),
) -> torch.Tensor:
    """``(3, B, L)`` rows ``[t; h; w]`` for ``input_ids (B, L)``; grids ``(n, 3)`` in order of appearance, a video's
    ``t`` counting its frames. second_per_grid_ts: must be None (GLM's video time is in the timestamp text).

    deviations: names from `DEVIATIONS` to reproduce (to tell a known transformers bug from a new one).
    Raises `InvalidInputError` when the vision runs and the grids disagree.
    """
    unknown = set(deviations) - DEVIATIONS.keys()
    if unknown:
        raise InvalidInputError("unknown rope-index deviations", why=f"{sorted(unknown)}",
                                supported=f"{sorted(DEVIATIONS)}")
    if second_per_grid_ts is not None:
        raise InvalidInputError("GLM-V takes no second_per_grid_ts", why="video time is written as timestamp text",
                                fix="drop the argument")
    merge = config.vision_config.spatial_merge_size
    images, frames = _grids(image_grid_thw, merge, frames=False), _grids(video_grid_thw, merge, frames=True)
    out = torch.ones(3, *input_ids.shape, dtype=torch.long)
    for b, row in enumerate(input_ids.tolist()):
        keep = [True] * len(row) if attention_mask is None else attention_mask[b].bool().tolist()
        tokens = [tok for tok, k in zip(row, keep) if k]
        pos: list[tuple[int, int, int]] = []
        i, nxt, depth = 0, 0, 0  # token index, first position after what came before, inside a video
        while i < len(tokens):
            tok = tokens[i]
            depth += (tok == config.video_start_token_id) - (tok == config.video_end_token_id)
            if tok != config.image_token_id:
                pos.append((nxt, nxt, nxt))
                nxt, i = nxt + 1, i + 1
                continue
            kind = "video frame" if depth > 0 else "image"
            try:
                t, h, w = next(frames if depth > 0 else images)
            except StopIteration:
                raise InvalidInputError(f"more {kind} runs than grids", why=f"row {b}, token {i}") from None
            run = next((j for j in range(i, len(tokens)) if tokens[j] != config.image_token_id), len(tokens)) - i
            if run < t * h * w:
                raise InvalidInputError(f"{kind} run shorter than its grid",
                                        why=f"row {b}, token {i}: {run} tokens, grid needs {t * h * w}")
            pos += [(nxt + ti, nxt + hi, nxt + wi) for ti in range(t) for hi in range(h) for wi in range(w)]
            i += t * h * w
            nxt = max(max(p) for p in pos) + 1
        flat = torch.tensor(pos, dtype=torch.long).T if pos else torch.empty(3, 0, dtype=torch.long)
        out[:, b, torch.tensor(keep, dtype=torch.bool)] = flat
    return out


def _grids(grid: torch.Tensor | None, merge: int, *, frames: bool) -> Iterator[tuple[int, int, int]]:
    """Merged ``(t, h, w)`` per item; with ``frames`` one ``(1, h, w)`` per frame of each video."""
    for t, h, w in grid.tolist() if grid is not None else []:
        for _ in range(t if frames else 1):
            yield (1 if frames else t), h // merge, w // merge
