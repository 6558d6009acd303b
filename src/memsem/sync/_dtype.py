"""dtype on read: bf16 (fp16, fp32) weights to fp8 e4m3fn with per-tensor or per-block scales.

The conversion is torch's, written once here (``to_fp8``) and used both by a reader on the
slice it loaded and by anyone on a full tensor: with block scales whose edges the slice
respects, the slice's result is bit-exact the same bytes as the full tensor's result sliced
(each block's scale is the block's own ``amax / 448``; each element is divided by its block's
scale and rounded by torch's cast). A per-tensor scale needs the whole tensor's ``amax``: a
reader converts per tensor only what it reads whole.

Scales are float32 and multiply (``weight = fp8 * scale``): vLLM's ``weight_scale`` (per
tensor) and ``weight_scale_inv`` (per ``(rows, cols)`` block, DeepSeek's layout; the name is
historical: it is the multiplier).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: the largest finite float8_e4m3fn
FP8_MAX = 448.0
#: the smallest amax a scale is made of (an all-zero block gets this, never a division by 0)
MIN_AMAX = 1e-12


def to_fp8(weight: Any, block: Sequence[int] | None = None) -> tuple[Any, Any]:
    """``(fp8 weight, float32 scales)`` of a CPU torch tensor (bf16, fp16 or fp32).

    ``block=None``: one scale, shape ``(1,)``: ``max(|w|) / 448``. ``block=(r, c)`` (2-d
    ``weight``): scales of shape ``(ceil(rows / r), ceil(cols / c))``, each its block's
    ``max(|w|) / 448`` (edge blocks are the part inside the tensor). Every element is
    ``(w / scale).clamp(-448, 448)`` cast by torch to ``float8_e4m3fn``. Pure; no copy of
    ``weight`` is kept.
    """
    import torch

    x = weight.float()
    if block is None:
        scale = torch.clamp(x.abs().amax(), min=MIN_AMAX).reshape(1) / FP8_MAX
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    bh, bw = (int(b) for b in block)
    n, k = x.shape
    nb, kb = -(-n // bh), -(-k // bw)
    pad = torch.zeros((nb * bh, kb * bw), dtype=torch.float32)
    pad[:n, :k] = x
    blocks = pad.view(nb, bh, kb, bw)
    scale = torch.clamp(blocks.abs().amax(dim=(1, 3)), min=MIN_AMAX) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bh, kb * bw)[:n, :k].contiguous(), scale


def scale_shape(part_shapes: Sequence[tuple[int, ...]], block: Sequence[int] | None, cat_dim: int) -> tuple[int, ...]:
    """The shape of a converted target's scales: one per source (per tensor), or the sources'
    block grids concatenated along ``cat_dim``."""
    if block is None:
        return (len(part_shapes),)
    grids = [tuple(-(-s // b) for s, b in zip(ps, block)) for ps in part_shapes]
    out = list(grids[0])
    if len(grids) > 1:
        out[cat_dim] = sum(g[cat_dim] for g in grids)
    return tuple(out)


def convert(staged: Any, part_shapes: Sequence[tuple[int, ...]], block: Sequence[int] | None, cat_dim: int,
            out: Any, scales: Any) -> None:
    """Convert a loaded target (``staged``: the sources' slices concatenated along ``cat_dim``,
    source dtype) part by part into ``out`` (fp8) and ``scales`` (float32)."""
    import torch

    at = 0
    qs, ss = [], []
    for ps in part_shapes:
        n = ps[cat_dim] if ps else 1
        part = staged.narrow(cat_dim, at, n) if len(part_shapes) > 1 else staged
        q, s = to_fp8(part, block)
        qs.append(q)
        ss.append(s)
        at += n
    out.copy_(torch.cat(qs, dim=cat_dim) if len(qs) > 1 else qs[0])
    if block is None:
        scales.copy_(torch.cat(ss))
    else:
        scales.copy_(torch.cat(ss, dim=cat_dim) if len(ss) > 1 else ss[0])


__all__ = ["FP8_MAX", "MIN_AMAX", "convert", "scale_shape", "to_fp8"]
