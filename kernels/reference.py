"""The bit-level definition of every FP8 kernel, in plain PyTorch.

Every Triton kernel in this package must match these functions bit for bit. All math is fp32 and
follows the numerics contract in DESIGN.md and the conventions in docs/INTERNALS.md:

- A tensor of any rank >= 1 is viewed as 2D ``(rows, cols) = (prod(shape[:-1]), shape[-1])`` for
  transpose, MXFP8 and block casts. Rowwise outputs keep the input's shape; columnwise outputs are
  the 2D transpose ``(cols, rows)``.
- Every cast to FP8 clamps to ``[-fp8_max, fp8_max]`` first: torch < 2.13 turned e4m3fn overflow
  into NaN, and e5m2 overflows to inf on its own. ``clamp`` keeps NaN, and torch's cast rounds to
  nearest even, so ``clamp`` then cast equals saturate(round(x * scale)).
- Scales are computed with fp32 IEEE division, never through float64, and power-of-two rounding
  works on the fp32 bits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from dist_quant.kernels.kinds_base import AmaxAlgo, spellings
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLT_MAX: float = torch.finfo(torch.float32).max

MXFP8_BLOCK = 32
FLOAT8_BLOCK = 128

_EXPONENT_MASK = 0x7F800000  # fp32 exponent bits; the sign is 0 for every scale we round
_E8M0_NAN = 255
_FP32_NAN_BITS = 0x7FC00000
_FP32_2_POW_M127_BITS = 0x00400000  # 2**-127 is an fp32 subnormal: E8M0 code 0


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of ``fp8_dtype``: 448.0 for E4M3, 57344.0 for E5M2."""
    _check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def amax(x: Tensor) -> Tensor:
    """``max(|x|)`` as an fp32 0-dim tensor; NaN propagates; an empty tensor gives 0."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().float().abs().amax()


def cast_to_fp8(x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype) -> Tensor:
    """Per-tensor saturating cast: ``saturate(rne(x.float() * scale))``, same shape as ``x``."""
    limit = fp8_max(fp8_dtype)
    scale_t = _scalar_fp32(scale, x.device, "cast_to_fp8: scale")
    return (x.detach().float() * scale_t).clamp(-limit, limit).to(fp8_dtype)


class CastStats(NamedTuple):
    """What a per-tensor cast did to ``x``: counts (int64 0-dim) and ``amax(x)`` (fp32 0-dim)."""

    saturated: Tensor  # elements whose |fp32(x * scale)| > fp8_max (inf included, NaN not): clamped
    underflowed: Tensor  # non-zero elements of x whose cast is +-0 (NaN is non-zero, never zero)
    nonzero: Tensor  # elements of x that are not +-0 (NaN included): the underflow denominator
    amax: Tensor  # max(|x|), NaN propagating, as ``amax``


def cast_stats(x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype) -> CastStats:
    """Telemetry of ``cast_to_fp8(x, scale, fp8_dtype)``, computed from the cast's own definition.

    Saturation is the clamp of the contract (``|x * scale| > fp8_max`` in fp32); underflow is a
    non-zero input whose saturating RNE cast is zero, which includes an fp32 product that is
    already 0. Nothing is synchronised with the host.
    """
    limit = fp8_max(fp8_dtype)
    scale_t = _scalar_fp32(scale, x.device, "cast_stats: scale")
    x32 = x.detach().float()
    v = x32 * scale_t
    nonzero = x32 != 0
    q = v.clamp(-limit, limit).to(fp8_dtype)
    underflowed = nonzero & (q.float() == 0)
    return CastStats((v.abs() > limit).sum(), underflowed.sum(), nonzero.sum(), amax(x))


def cast_transpose(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Cast ``x`` and also return the contiguous 2D transpose ``(cols, rows)`` of the result."""
    rows, cols = _rows_cols(x, "cast_transpose")
    q = cast_to_fp8(x, scale, fp8_dtype)
    return q, q.reshape(rows, cols).t().contiguous()


def current_scale(
    amax: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
) -> tuple[Tensor, Tensor]:
    """Current-scaling ``(scale, scale_inv)``, fp32 with ``amax``'s shape.

    ``amax`` is floored at ``amax_epsilon``; ``scale = fp8_max / amax``; an amax of 0, inf or NaN
    gives scale 1; an infinite scale becomes FLT_MAX; ``use_power_2_scales`` rounds down to a power
    of two by zeroing the mantissa bits. ``scale_inv = 1 / scale``.
    """
    if not amax_epsilon >= 0.0:
        raise ValueError(f"current_scale: amax_epsilon must be >= 0, got {amax_epsilon!r}")
    a = amax.float()
    if amax_epsilon > 0.0:
        a = torch.maximum(a, torch.full_like(a, amax_epsilon))  # maximum keeps NaN
    scale = _scale_from_amax(a, fp8_max(fp8_dtype), use_power_2_scales)
    return scale, torch.ones_like(scale) / scale


def delayed_amax(amax_history: Tensor, algo: AmaxAlgo | str) -> Tensor:
    """The amax a delayed-scaling update scales from, fp32 ``(n,)``, NaN propagating.

    ``amax_history`` is ``(L, n)`` in Transformer Engine's layout: row 0 is this step's amax (the
    accumulator quantizers fold ``max(|x|)`` into, already reduced across ranks when the update
    runs), rows 1..L-1 earlier steps. ``"max"``: the max over all L rows; ``"most_recent"``: row 0.
    """
    if algo not in tuple(AmaxAlgo):
        raise ValueError(f"delayed_amax: algo must be {spellings(AmaxAlgo)}, got {algo!r}")
    return amax_history.amax(0) if algo == AmaxAlgo.MAX else amax_history[0].clone()


def delayed_scale(
    amax: Tensor, scale: Tensor, fp8_max_per_slot: Tensor | float, *, margin: float
) -> Tensor:
    """The delayed-scaling scale rule, a new fp32 ``(n,)`` tensor: ``(fp8_max / amax) / 2**margin``
    in fp32; slots whose ``amax`` is not finite or ``<= 0`` keep ``scale``; an infinite quotient
    becomes FLT_MAX."""
    n = scale.shape[0]
    limit = torch.as_tensor(fp8_max_per_slot, dtype=torch.float32, device=scale.device)
    divisor = torch.tensor(2.0**margin, dtype=torch.float32, device=scale.device)
    new = (limit.expand(n) / amax) / divisor
    new = torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new)
    keep = ~torch.isfinite(amax) | (amax <= 0)
    return torch.where(keep, scale, new)


def roll_amax_history(amax_history: Tensor) -> None:
    """Close a step, in place: ``history[:] = history.roll(-1, 0)`` (this step's row becomes the
    last, the oldest row is dropped) and row 0, the next step's accumulator, is zeroed. In place so
    quantizers' views of row 0 stay valid."""
    amax_history.copy_(amax_history.roll(-1, 0))
    amax_history[0].zero_()


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    *,
    margin: float,
    algo: AmaxAlgo | str,
) -> None:
    """One delayed-scaling step, fully in place (views into ``scale`` and ``history[0]`` survive):
    ``scale = delayed_scale(delayed_amax(history, algo), scale, fp8_max, margin)``, then
    ``roll_amax_history(history)``."""
    _check_delayed("delayed_scaling_update", amax_history, scale, fp8_max_per_slot, margin, algo)
    a = delayed_amax(amax_history, algo)
    scale.copy_(delayed_scale(a, scale, fp8_max_per_slot, margin=margin))
    roll_amax_history(amax_history)


def rescale_from_history(
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    *,
    margin: float,
    algo: AmaxAlgo | str,
) -> None:
    """At a step boundary, the scale the last update would have produced under ``margin`` /
    ``algo`` (a recipe switch that keeps the history but changes them), written into ``scale`` in
    place; the history is not changed.

    Between steps the history is as that update left it, rolled: this step's row went last and row
    0 is the (empty) next accumulator. Rolling it back by one puts the newest step in row 0 again,
    so ``delayed_amax`` reads it with the update's own meaning; only the window's oldest step,
    which the roll dropped, reads as 0. With L = 1 nothing is kept, so the scale stays.
    """
    _check_delayed("rescale_from_history", amax_history, scale, fp8_max_per_slot, margin, algo)
    a = delayed_amax(amax_history.roll(1, 0), algo)
    scale.copy_(delayed_scale(a, scale, fp8_max_per_slot, margin=margin))


def check_delayed(
    what: str, amax_history: Tensor, scale: Tensor, margin: object, algo: object
) -> int:
    """Validate one delayed-scaling group's history, scale, margin and algorithm (the reference
    and ``delayed_update.py``'s kernel take the same groups); returns the slot count ``n``."""
    if algo not in tuple(AmaxAlgo):
        raise ValueError(f"{what}: algo must be {spellings(AmaxAlgo)}, got {algo!r}")
    if amax_history.dim() != 2 or amax_history.shape[0] < 1:
        raise ValueError(
            f"{what}: amax_history must be 2D (L >= 1, n), got shape {tuple(amax_history.shape)}"
        )
    n = amax_history.shape[1]
    if tuple(scale.shape) != (n,):
        raise ValueError(
            f"{what}: scale must have shape ({n},) to match amax_history "
            f"{tuple(amax_history.shape)}, got {tuple(scale.shape)}"
        )
    for name, t in (("amax_history", amax_history), ("scale", scale)):
        if t.dtype != torch.float32:
            raise ValueError(f"{what}: {name} must be float32, got {t.dtype}")
    if not (isinstance(margin, (int, float)) and margin >= 0):
        raise ValueError(f"{what}: margin must be a number >= 0, got {margin!r}")
    return n


def _check_delayed(
    what: str,
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    margin: object,
    algo: object,
) -> None:
    n = check_delayed(what, amax_history, scale, margin, algo)
    if isinstance(fp8_max_per_slot, Tensor) and fp8_max_per_slot.numel() not in (1, n):
        raise ValueError(
            f"{what}: fp8_max_per_slot must hold 1 or {n} values, "
            f"got shape {tuple(fp8_max_per_slot.shape)}"
        )


def mxfp8_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, columnwise: bool = False
) -> tuple[Tensor, Tensor]:
    """MXFP8 cast: ``(q, e8m0)``, one shared power-of-two scale per 32 elements.

    Rowwise: blocks along the last dim; ``q`` keeps ``x``'s shape, ``e8m0`` is uint8
    ``(rows, ceil(cols/32))``. Columnwise: blocks along the first dim of the 2D view; ``q`` is the
    transposed ``(cols, rows)`` and ``e8m0`` is ``(cols, ceil(rows/32))``. A ragged tail forms a
    short block.

    Block exponent (exact RCEIL): the smallest ``E`` in [0, 254] with
    ``2**(E - 127) * fp8_max >= amax_block``; a non-finite amax gives 255 (NaN), whose block
    decodes to NaN. Data: ``saturate(rne(x * 2**(127 - E)))``.
    """
    limit = fp8_max(fp8_dtype)
    rows, cols = _rows_cols(x, "mxfp8_cast")
    x2d = x.detach().reshape(rows, cols).float()
    if columnwise:
        x2d = x2d.t()
    blocks = _split_last(x2d, MXFP8_BLOCK)  # (r, nblocks, 32), zero padded
    block_amax = blocks.abs().amax(-1)  # (r, nblocks); NaN propagates
    e8m0 = rceil_e8m0(block_amax, limit)
    # 2**(127 - E) from its fp32 bits: exact for E in [0, 253]; E = 255 gives NaN.
    multiplier = ((254 - e8m0).clamp(min=0) << 23).view(torch.float32)
    multiplier = torch.where(e8m0 == _E8M0_NAN, torch.full_like(multiplier, math.nan), multiplier)
    scaled = blocks * multiplier.unsqueeze(-1)
    r, c = x2d.shape
    q = scaled.clamp(-limit, limit).to(fp8_dtype).reshape(r, blocks.shape[1] * MXFP8_BLOCK)[:, :c]
    q = q.contiguous() if columnwise else q.reshape(x.shape)
    return q, e8m0.to(torch.uint8)


def rceil_e8m0(amax: Tensor, fp8_max_value: float) -> Tensor:
    """E8M0 codes (int32) for fp32 amaxes: the smallest ``E`` in [0, 254] with
    ``2**(E - 127) * fp8_max >= amax``, 255 for a non-finite amax.

    With ``v = amax / fp8_max`` (fp32 IEEE division), ``E`` = the exponent bits of ``v`` plus 1 if
    its mantissa bits are non-zero. That is exact wherever ``v`` is normal: fp8_max is 7 * 2**k,
    so a quotient just above a power of two never rounds down onto it. Below
    ``2**-127 * fp8_max`` (an exact fp32 constant) the rounded subnormal ``v`` would give 1, so
    those blocks (zero included) take 0 explicitly. Finite ``v`` is below 2**120: E <= 247.
    """
    bits = (amax / fp8_max_value).view(torch.int32)
    e8m0 = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e8m0 = torch.where(amax <= fp8_max_value * 2.0**-127, torch.zeros_like(e8m0), e8m0)
    return torch.where(torch.isfinite(amax), e8m0, torch.full_like(e8m0, _E8M0_NAN))


def mxfp8_dequantize(
    q: Tensor, e8m0: Tensor, *, columnwise: bool = False, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``q * 2**(E - 127)`` in fp32, then cast to ``dtype``; E = 255 decodes to NaN.

    Blocks run along ``q``'s last dim in both layouts. With ``columnwise=True`` ``q`` is the 2D
    ``(cols, rows)`` output of ``mxfp8_cast(..., columnwise=True)`` and the result is transposed
    back to the ``(rows, cols)`` view of the original tensor.
    """
    rows, cols = _rows_cols(q, "mxfp8_dequantize")
    expected = (rows, -(-cols // MXFP8_BLOCK))
    if tuple(e8m0.shape) != expected or e8m0.dtype != torch.uint8:
        raise ValueError(
            f"mxfp8_dequantize: e8m0 must be uint8 of shape {expected} for data of shape "
            f"{tuple(q.shape)}, got {e8m0.dtype} {tuple(e8m0.shape)}"
        )
    if columnwise and q.dim() != 2:
        raise ValueError(f"mxfp8_dequantize: columnwise data must be 2D, got {tuple(q.shape)}")
    e = e8m0.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, _FP32_2_POW_M127_BITS), e << 23)
    bits = torch.where(e == _E8M0_NAN, torch.full_like(e, _FP32_NAN_BITS), bits)
    multiplier = bits.view(torch.float32).repeat_interleave(MXFP8_BLOCK, dim=1)[:, :cols]
    out = q.reshape(rows, cols).float() * multiplier
    out = out.t() if columnwise else out.reshape(q.shape)
    return out.to(dtype)


def block_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, block_dim: int, use_power_2_scales: bool = True
) -> tuple[Tensor, Tensor]:
    """Float8 block cast: ``(q, scale_inv)``, one fp32 scale per tile; ``q`` keeps ``x``'s shape.

    ``block_dim=1``: 1x128 tiles along the last dim, ``scale_inv`` ``(rows, ceil(cols/128))``.
    ``block_dim=2``: 128x128 tiles, ``scale_inv`` ``(ceil(rows/128), ceil(cols/128))``.
    Tile scale ``s = fp8_max / amax_tile``; amax 0 or non-finite gives 1; inf gives FLT_MAX;
    power-of-two rounds down on the fp32 bits. ``scale_inv = 1 / s``. Ragged tiles are short.
    """
    limit = fp8_max(fp8_dtype)
    rows, cols = _rows_cols(x, "block_cast")
    x2d = x.detach().reshape(rows, cols).float()
    tiles = _tile(x2d, block_dim)  # (tile_rows, r, tile_cols, 128)
    tile_amax = tiles.abs().amax(dim=(1, 3))  # NaN propagates
    scale = _scale_from_amax(tile_amax, limit, use_power_2_scales)
    scaled = tiles * scale[:, None, :, None]
    q = _untile(scaled.clamp(-limit, limit).to(fp8_dtype), rows, cols).reshape(x.shape)
    return q, torch.ones_like(scale) / scale


def block_dequantize(
    q: Tensor, scale_inv: Tensor, *, block_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``q * scale_inv`` of each element's tile in fp32, cast to ``dtype``, in ``q``'s shape."""
    rows, cols = _rows_cols(q, "block_dequantize")
    expected = _block_scale_shape(rows, cols, block_dim)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"block_dequantize: scale_inv must have shape {expected} for data {tuple(q.shape)} "
            f"with block_dim={block_dim}, got {tuple(scale_inv.shape)}"
        )
    s = scale_inv.float().repeat_interleave(FLOAT8_BLOCK, dim=1)[:, :cols]
    if block_dim == 2:
        s = s.repeat_interleave(FLOAT8_BLOCK, dim=0)[:rows]
    return (q.reshape(rows, cols).float() * s).reshape(q.shape).to(dtype)


def dequantize(q: Tensor, scale_inv: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-tensor dequantize: ``q.float() * scale_inv`` in fp32, then cast to ``dtype``."""
    return (q.float() * _scalar_fp32(scale_inv, q.device, "dequantize: scale_inv")).to(dtype)


def _check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"kernels.reference: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype!r}"
        )


def _scalar_fp32(value: Tensor | float, device: torch.device, what: str) -> Tensor:
    """A 0-dim fp32 tensor, so a (1,)-shaped scale never broadcasts a 0-dim input up to 1D."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{what} must hold exactly one value, got shape {tuple(t.shape)}")
    return t.reshape(())


def _rows_cols(x: Tensor, what: str) -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError(f"{what}: needs a tensor of rank >= 1 to view as (rows, cols), got 0-dim")
    return math.prod(x.shape[:-1]), x.shape[-1]


def _scale_from_amax(a: Tensor, limit: float, use_power_2_scales: bool) -> Tensor:
    """``limit / a`` in fp32; 0 / inf / NaN amax -> 1; inf -> FLT_MAX; optional power of two."""
    scale = torch.full_like(a, limit) / a
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    usable = torch.isfinite(a) & (a > 0)
    scale = torch.where(usable, scale, torch.ones_like(scale))
    if use_power_2_scales:
        # Zeroing the mantissa rounds a positive normal float down to a power of two.
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return scale


def _split_last(x2d: Tensor, block: int) -> Tensor:
    """``(r, c)`` -> ``(r, ceil(c/block), block)``, zero padded (zeros never raise an amax)."""
    r, c = x2d.shape
    nblocks = -(-c // block)
    padded = torch.nn.functional.pad(x2d, (0, nblocks * block - c))
    return padded.reshape(r, nblocks, block)


def _block_scale_shape(rows: int, cols: int, block_dim: int) -> tuple[int, int]:
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
    tile_cols = -(-cols // FLOAT8_BLOCK)
    return (rows, tile_cols) if block_dim == 1 else (-(-rows // FLOAT8_BLOCK), tile_cols)


def _tile(x2d: Tensor, block_dim: int) -> Tensor:
    """``(rows, cols)`` -> ``(tile_rows, tile_height, tile_cols, 128)``, zero padded."""
    rows, cols = x2d.shape
    tile_rows, tile_cols = _block_scale_shape(rows, cols, block_dim)
    height = 1 if block_dim == 1 else FLOAT8_BLOCK
    padded = torch.nn.functional.pad(
        x2d, (0, tile_cols * FLOAT8_BLOCK - cols, 0, tile_rows * height - rows)
    )
    return padded.reshape(tile_rows, height, tile_cols, FLOAT8_BLOCK)


def _untile(tiles: Tensor, rows: int, cols: int) -> Tensor:
    t_rows, height, t_cols, width = tiles.shape
    return tiles.reshape(t_rows * height, t_cols * width)[:rows, :cols]
