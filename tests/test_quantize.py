"""Block quantisation to e4m3: exact round trips on representable values, scales as specified, pow2 and e8m0.

Runs in the Triton interpreter on CPU (see conftest.py); shapes are small and include ragged edges (dims that are not
multiples of the block).
"""

import pytest
import torch

from prime_megamoe.ops import fp8_launch as fl
from prime_megamoe.ops.routing_plan import allocate_routing_plan, build_routing_plan, fill_routing_plan
from tests.oracle import ragged_routing

FP8 = torch.float8_e4m3fn


def _e4m3_values(shape, gen, *, max_in_block: float | None = None):
    """Random finite e4m3 values (as fp32), never NaN."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # 0x7F / 0xFF are NaN
    return codes.view(FP8).float()


def _set_block_max(q: torch.Tensor, block: tuple[int, int], value: float) -> torch.Tensor:
    """Put +-value at the first element of every (block_m x block_k) block of q (2-D), so each block's amax is it."""
    q = q.clone().clamp(-abs(value), abs(value))
    q[:: block[0], :: block[1]] = value
    return q


def _ref_scales(x: torch.Tensor, bm: int, bk: int, pow2: bool) -> torch.Tensor:
    m, k = x.shape
    xp = torch.nn.functional.pad(x, (0, (-k) % bk, 0, (-m) % bm))
    amax = xp.view(xp.shape[0] // bm, bm, xp.shape[1] // bk, bk).abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, torch.clamp(amax / 448.0, min=2.0**-126), torch.ones_like(amax))
    if pow2:  # round up to a power of two: s = m * 2^e with m in [0.5, 1) -> 2^e, unless s is one already
        mant, exp = torch.frexp(s)
        s = torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))
    return s


def _expand(s: torch.Tensor, bm: int, bk: int, m: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:m, :k]


@pytest.mark.parametrize("k", [256, 200])
def test_rows_fp8_exact_on_representable(k):
    """x = q * s with e4m3 q (each 1x128 block holding 448) and a short-mantissa s: round trip is exact."""
    gen = torch.Generator().manual_seed(0)
    rows, nb = 6, (k + 127) // 128
    q = _set_block_max(_e4m3_values((rows, k), gen), (1, 128), 448.0)
    s = torch.tensor([0.75, 0.625, 1.0, 0.875, 1.5, 0.5])[:, None] * torch.exp2(
        torch.randint(-20, 20, (rows, nb), generator=gen).float()
    )
    x = q * _expand(s, 1, 128, rows, k)
    qt = fl.quantize_rows(x, fl.fp8_format())
    assert qt.data.dtype == FP8 and qt.scale.dtype == torch.float32 and qt.scale.shape == (rows, nb)
    assert torch.equal(qt.scale, s)
    assert torch.equal(qt.data.float(), q)
    assert torch.equal(fl.dequantize_rows(qt, fl.fp8_format()), x)


@pytest.mark.parametrize("fmt", [fl.fp8_format(pow2=True), fl.MX_FORMAT], ids=["fp8_pow2", "mx"])
def test_rows_pow2_exact_on_representable(fmt):
    """x = q * 2^e with block max in (224, 448]: the scale is exactly 2^e (e8m0 byte e + 127) and x comes back."""
    gen = torch.Generator().manual_seed(1)
    rows, k, g = 5, 160, fmt.group
    nb = (k + g - 1) // g
    peak = torch.tensor([448.0, 240.0, 320.0, 416.0, 288.0])
    q = _e4m3_values((rows, k), gen).clamp(-224, 224)
    q[:, ::g] = peak[:, None]
    e = torch.randint(-30, 30, (rows, nb), generator=gen)
    x = q * _expand(torch.exp2(e.float()), 1, g, rows, k)
    qt = fl.quantize_rows(x, fmt)
    assert torch.equal(qt.data.float(), q)
    if fmt.mx:
        assert qt.scale.dtype == torch.uint8 and torch.equal(qt.scale.long(), e + 127)
    else:
        assert torch.equal(qt.scale, torch.exp2(e.float()))
    assert torch.equal(fl.dequantize_rows(qt, fmt), x)


@pytest.mark.parametrize(
    "fmt", [fl.fp8_format(), fl.fp8_format(pow2=True), fl.MX_FORMAT], ids=["fp8", "fp8_pow2", "mx"]
)
def test_rows_scales_and_rounding_match_reference(fmt):
    """Random data: scales = amax / 448 (pow2: rounded up), values = e4m3 round-to-nearest-even of x / scale."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, 300, generator=gen) * torch.exp2(torch.randint(-8, 8, (33, 1), generator=gen).float())
    x[3] = 0.0  # an all-zero row: scale 1
    x[4, :40] = 1e-40  # subnormal fp32 values: no inf / nan
    qt = fl.quantize_rows(x, fmt)
    s = _ref_scales(x, 1, fmt.group, fmt.pow2)
    if fmt.mx:
        assert torch.equal(qt.scale.long(), torch.frexp(s)[1].long() - 1 + 127)
    else:
        assert torch.equal(qt.scale, s)
    inv = 1.0 / _expand(s, 1, fmt.group, *x.shape)
    ref = (x * inv).clamp(-448, 448).to(FP8)
    assert torch.equal(qt.data.view(torch.uint8), ref.view(torch.uint8))
    y = fl.dequantize_rows(qt, fmt)
    assert torch.isfinite(y).all()
    assert torch.equal(y[3], torch.zeros(300))
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for values in the normal range of their block.
    big = x.abs() >= _expand(s, 1, fmt.group, *x.shape) * 2.0**-6
    assert ((y - x).abs()[big] <= x.abs()[big] * 2.0**-4 + 1e-30).all()
    if fmt.pow2 and not fmt.mx:
        assert (torch.frexp(qt.scale)[0] == 0.5).all()


@pytest.mark.parametrize("fmt", [fl.fp8_format(), fl.fp8_format(pow2=True), fl.MX_FORMAT], ids=["fp32", "pow2", "mx"])
def test_rows_quantised_by_the_routing_launch_match_quantize_rows(fmt):
    """The quantised forward's x, quantised by the routing plan's first launch (``fl.row_quantization``), gives
    ``quantize_rows``' bits and scales; the plan is the one a plain fill makes. Ragged: 37 rows (not a multiple of
    the 64-row tile), 300 columns (not a multiple of the group), an expert with no rows, one with most."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 300, generator=gen) * torch.exp2(torch.randint(-8, 8, (37, 1), generator=gen).float())
    x[5] = 0.0
    index, weights = ragged_routing(37, 6, 2, seed=5)
    want = fl.quantize_rows(x, fmt)
    plain = build_routing_plan(index, weights, expert_base=0, num_local_experts=6, tile_m=128)
    got, request = fl.row_quantization(x, fmt)
    plan = allocate_routing_plan(37, 2, num_local_experts=6, tile_m=128, device=x.device)
    fill_routing_plan(plan, index, weights, expert_base=0, quantize=request)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
    for part in ("counts", "expert_offsets", "pair_pos", "num_tiles"):
        assert torch.equal(getattr(plan, part), getattr(plain, part)), part
    with pytest.raises(ValueError, match="contiguous rows"):
        fl.row_quantization(x.t(), fmt)


def test_rows_segments_are_blocked_separately():
    """[gate | up] rows with I = 96: each half gets its own 1x128 group range."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 192, generator=gen)
    fmt = fl.fp8_format()
    qt = fl.quantize_rows(x, fmt, segments=2)
    gate, up = fl.quantize_rows(x[:, :96].contiguous(), fmt), fl.quantize_rows(x[:, 96:].contiguous(), fmt)
    assert torch.equal(qt.scale, torch.cat([gate.scale, up.scale], 1))
    assert torch.equal(qt.data.view(torch.uint8), torch.cat([gate.data, up.data], 1).view(torch.uint8))
    assert torch.equal(
        fl.dequantize_rows(qt, fmt, segments=2),
        torch.cat([fl.dequantize_rows(gate, fmt), fl.dequantize_rows(up, fmt)], 1),
    )


def test_weight_blocks_exact_and_transposed_copy():
    """W1 [E, 2I, H] with I = 96, H = 200: 128x128 blocks per half; exact on representable values; the transposed
    (dgrad) copy holds the same values and scales, transposed."""
    gen = torch.Generator().manual_seed(4)
    e, inter, hidden = 2, 96, 200
    fmt = fl.fp8_format()
    # One row block per half (96 rows) and two column blocks (128 + 72): scales [E, half, column block].
    s = torch.tensor([0.75, 1.25, 0.625])[torch.randint(0, 3, (e, 2, 2), generator=gen)]
    s = s * torch.exp2(torch.randint(-10, 10, (e, 2, 2), generator=gen).float())
    q = torch.empty(e, 2 * inter, hidden)
    w = torch.empty(e, 2 * inter, hidden)
    for i in range(e):
        for h in range(2):
            part = _set_block_max(_e4m3_values((inter, hidden), gen), (128, 128), -448.0)
            q[i, h * inter : (h + 1) * inter] = part
            w[i, h * inter : (h + 1) * inter] = part * _expand(s[i, h][None], 128, 128, inter, hidden)
    fwd = fl.quantize_w1_fwd(w, fmt)
    assert fwd.data.shape == (e, 2 * inter, hidden) and fwd.scale.shape == (e, 2, 2)
    assert torch.equal(fwd.scale, s)
    assert torch.equal(fwd.data.float(), q)
    assert torch.equal(fl.dequantize_weight(fwd, fmt, n_halves=2), w)
    bwd = fl.quantize_w1_bwd(w, fmt)
    assert bwd.data.shape == (e, hidden, 2 * inter) and bwd.scale.shape == (e, 2, 2)
    assert torch.equal(bwd.data.view(torch.uint8), fwd.data.transpose(1, 2).view(torch.uint8))
    assert torch.equal(bwd.scale, fwd.scale.transpose(1, 2))
    assert torch.equal(fl.dequantize_weight(bwd, fmt, k_halves=2), w.transpose(1, 2))


@pytest.mark.parametrize(
    "fmt", [fl.fp8_format(), fl.fp8_format(pow2=True), fl.MX_FORMAT], ids=["fp8", "fp8_pow2", "mx"]
)
def test_weight_operands_match_reference(fmt):
    """All four weight operands against a plain torch block quantiser (W2 [E, H, I] too)."""
    gen = torch.Generator().manual_seed(5)
    e, inter, hidden = 2, 96, 160
    w1 = torch.randn(e, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(e, hidden, inter, generator=gen)
    bm, bk = fmt.weight_rows, fmt.group

    def ref(mat):  # 2-D [N, K] -> dequantised
        s = _expand(_ref_scales(mat, bm, bk, fmt.pow2), bm, bk, *mat.shape)
        return (mat * (1.0 / s)).clamp(-448, 448).to(FP8).float() * s

    cases = [
        (fl.quantize_w1_fwd(w1, fmt), {"n_halves": 2}, [torch.cat([ref(w[:inter]), ref(w[inter:])]) for w in w1]),
        (
            fl.quantize_w1_bwd(w1, fmt),
            {"k_halves": 2},
            [torch.cat([ref(w[:inter].T), ref(w[inter:].T)], 1) for w in w1],
        ),
        (fl.quantize_w2_fwd(w2, fmt), {}, [ref(w) for w in w2]),
        (fl.quantize_w2_bwd(w2, fmt), {}, [ref(w.T) for w in w2]),
    ]
    for qt, kw, expected in cases:
        assert qt.scale.dtype == fmt.scale_dtype
        assert torch.equal(fl.dequantize_weight(qt, fmt, **kw), torch.stack(expected))


# ----------------------------------------------------------------------------------------------------------------
# Weight-gradient operands: gathered sorted rows, column-scaled per 128-row tile, stored transposed in tile space
# ----------------------------------------------------------------------------------------------------------------
def _ragged_plan(tokens, experts, top_k, seed, device="cpu"):
    """Routing with expert 0 empty and expert 1 taking most rows (more than one 128-row tile, not a multiple of 128)."""
    index, weights = ragged_routing(tokens, experts, top_k, seed=seed, hot_fraction=0.9)
    plan = build_routing_plan(
        index.to(device), weights.to(device), expert_base=0, num_local_experts=experts, tile_m=128
    )
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    assert counts[0] == 0 and counts[1] > 128 and counts[1] % 128 != 0 and counts[1] == counts.max()
    return plan


def _ref_cols_t(x, plan, fmt):
    """Per tile of the plan (on any device; x on the CPU): (tile id, q^T [K, 128] e4m3, scales [128 // G, K] fp32),
    from a plain torch quantiser."""
    offsets, row_src = plan.expert_offsets.tolist(), plan.row_src.long().cpu()
    g = fmt.group
    for t in range(int(plan.num_tiles[0])):
        e, r0 = int(plan.tile_expert[t]), int(plan.tile_row[t])
        r1 = min(r0 + 128, offsets[e + 1])
        tile = torch.zeros(128, x.shape[1])
        tile[: r1 - r0] = x[row_src[r0:r1]].float()
        s = _ref_scales(tile, g, 1, fmt.pow2)
        q = (tile * (1.0 / _expand(s, g, 1, *tile.shape))).clamp(-448, 448).to(FP8)
        yield t, q.T, s


@pytest.mark.parametrize(
    "fmt,dtype",
    [(fl.fp8_format(), torch.float32), (fl.fp8_format(pow2=True), torch.bfloat16), (fl.MX_FORMAT, torch.bfloat16)],
    ids=["fp8", "fp8_pow2_bf16", "mx_bf16"],
)
def test_sorted_cols_t_matches_reference(fmt, dtype):
    """quantize_sorted_cols_t: x[row_src] gathered per tile, one scale per column and G-row block, values transposed
    at columns 128 t + j, zeros past each expert's end; exact bits against torch."""
    tokens, experts, top_k, hidden = 150, 4, 2, 200
    plan = _ragged_plan(tokens, experts, top_k, seed=6)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=gen) * torch.exp2(torch.randint(-6, 6, (tokens, 1), generator=gen))
    x[:, 5] = 0.0  # an all-zero column: scale 1
    x = x.to(dtype)
    qt = fl.quantize_sorted_cols_t(x, plan, fmt)
    blocks = 128 // fmt.group
    assert qt.data.shape == (hidden, plan.max_tiles * 128) and qt.data.dtype == FP8
    assert qt.scale.shape == (plan.max_tiles * blocks, hidden) and qt.scale.dtype == fmt.scale_dtype
    tiles = 0
    for t, q_ref, s_ref in _ref_cols_t(x, plan, fmt):
        q = qt.data[:, t * 128 : (t + 1) * 128]
        s = qt.scale[t * blocks : (t + 1) * blocks]
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"tile {t} values"
        if fmt.mx:
            assert torch.equal(s.long(), torch.frexp(s_ref)[1].long() - 1 + 127), f"tile {t} scales"
        else:
            assert torch.equal(s, s_ref), f"tile {t} scales"
        tiles += 1
    assert tiles == 4  # expert 1 in two tiles, experts 2 and 3 in one each; the empty expert in none


def test_sorted_cols_t_rejects_other_plans():
    index, weights = ragged_routing(8, 4, 2, seed=0)
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="tile_m = 128"):
        fl.quantize_sorted_cols_t(
            x, build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=16), fl.fp8_format()
        )
    plan = build_routing_plan(index, weights, expert_base=0, num_local_experts=4, tile_m=128)
    with pytest.raises(ValueError, match="source rows"):
        fl.quantize_sorted_cols_t(x[:4], plan, fl.fp8_format())
