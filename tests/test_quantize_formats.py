"""Quantization: AWQ/GPTQ int32 layouts pinned bit for bit, RTN's error bound, GPTQ and AWQ beat RTN."""

import torch

from vserve.quantize.awq import quantize_awq
from vserve.quantize.formats import (
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq,
    unpack_awq,
    unpack_gptq,
)
from vserve.quantize.gptq import hessian, quantize_gptq, quantize_gptq_channel
from vserve.quantize.rtn import dequantize, fake_quantize, group_index, quantize_rtn
from vserve.quantize.w8a8 import dequantize_weight, quantize_weight, round_to_grid


def _codes(out_features: int, in_features: int, group_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (out_features, in_features // group_size), generator=g, dtype=torch.int32)
    scales = (torch.rand(out_features, in_features // group_size, generator=g) + 0.01).half()
    return q, zeros, scales


def test_awq_packs_columns_in_nibble_order_0_2_4_6_1_3_5_7():
    q = torch.arange(1, 9, dtype=torch.int32)[None, :].t().contiguous()  # out 0..7 = codes 1..8, one input
    zeros = torch.tensor([[15, 0, 1, 2, 3, 4, 5, 6]], dtype=torch.int32).t().contiguous()
    qweight, qzeros, scales = pack_awq(q, zeros, torch.ones(8, 1))
    # nibbles low to high hold columns 0,2,4,6,1,3,5,7 -> codes 1,3,5,7,2,4,6,8 -> 0x86427531 (sign bit set)
    assert qweight.dtype == torch.int32 and qweight.shape == (1, 1)
    assert qweight.item() == 0x86427531 - 2**32
    assert qzeros.item() == 0x6420531F  # columns' zeros 15,1,3,5,0,2,4,6 from nibble 0 up
    assert scales.dtype == torch.float16 and scales.shape == (1, 8)


def test_gptq_packs_inputs_sequentially_and_stores_zeros_minus_one():
    q = torch.zeros(8, 8, dtype=torch.int32)
    q[0] = torch.arange(1, 9)  # output 0, inputs 0..7 = codes 1..8
    zeros = torch.arange(1, 9, dtype=torch.int32)[:, None]  # one group; output j has zero j + 1
    qweight, qzeros, scales, g_idx = pack_gptq(q, zeros, torch.ones(8, 1), torch.zeros(8, dtype=torch.int32))
    assert qweight.shape == (1, 8) and qzeros.shape == (1, 1) and scales.shape == (1, 8)
    assert qweight[0, 0].item() == 0x87654321 - 2**32
    assert qweight[0, 1:].tolist() == [0] * 7
    assert qzeros.item() == 0x76543210  # zeros 1..8 stored as 0..7
    assert g_idx.dtype == torch.int32


def test_awq_round_trip_and_dequantize_match_hand_computation():
    q, zeros, scales = _codes(out_features=32, in_features=256, group_size=64)
    qweight, qzeros, s16 = pack_awq(q, zeros, scales)
    assert qweight.shape == (256, 4) and qzeros.shape == (4, 4) and s16.shape == (4, 32)
    q2, z2, s2 = unpack_awq(qweight, qzeros, s16)
    assert torch.equal(q2, q) and torch.equal(z2, zeros) and torch.equal(s2, scales)
    W = dequantize_awq(qweight, qzeros, s16, group_size=64)
    assert W.shape == (32, 256)
    o, i = 5, 130  # group 2
    assert W[o, i].item() == (q[o, i].item() - zeros[o, 2].item()) * scales[o, 2].float().item()
    expected = (q.float() - zeros.float().repeat_interleave(64, 1)) * scales.float().repeat_interleave(64, 1)
    assert torch.equal(W, expected)


def test_gptq_round_trip_with_act_order_g_idx_and_dequantize():
    q, zeros, scales = _codes(out_features=16, in_features=128, group_size=32, seed=1)
    g_idx = group_index(128, 32)[torch.randperm(128, generator=torch.Generator().manual_seed(2))]
    qweight, qzeros, s16, g = pack_gptq(q, zeros, scales, g_idx)
    assert qweight.shape == (16, 16) and qzeros.shape == (4, 2)
    q2, z2, s2, g2 = unpack_gptq(qweight, qzeros, s16, g)
    assert torch.equal(q2, q) and torch.equal(z2, zeros) and torch.equal(s2, scales) and torch.equal(g2, g_idx)
    W = dequantize_gptq(qweight, qzeros, s16, g)
    o, i = 3, 77
    gi = g_idx[i].item()
    assert W[o, i].item() == (q[o, i].item() - zeros[o, gi].item()) * scales[o, gi].float().item()


def test_gptq_8bit_and_sym_round_trip():
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (8, 64), generator=g, dtype=torch.int32)
    zeros = torch.full((8, 2), 128, dtype=torch.int32)
    packed = pack_gptq(q, zeros, torch.ones(8, 2), group_index(64, 32), bits=8, sym=True)
    assert packed[0].shape == (16, 8)
    q2, z2, _, _ = unpack_gptq(*packed, bits=8)
    assert torch.equal(q2, q) and torch.equal(z2, zeros)


def test_rtn_error_is_at_most_half_a_step_per_element():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    for bits in (4, 8):
        q, zeros, scales = quantize_rtn(w, bits=bits, group_size=64)
        assert int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1
        deq = dequantize(q, zeros, scales, group_index(256, 64))
        step = scales.repeat_interleave(64, dim=1)
        assert bool(((w - deq).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())
        assert torch.equal(deq, fake_quantize(w, bits, 64))


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return torch.linalg.norm(x @ w.t() - x @ wq.t()).item()


def test_gptq_has_lower_output_error_than_rtn_on_correlated_activations():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g)
    mix = torch.randn(256, 256, generator=g) / 16 + torch.eye(256)
    low_rank = torch.randn(1024, 32, generator=g) @ torch.randn(32, 256, generator=g)
    x = (low_rank + 0.1 * torch.randn(1024, 256, generator=g)) @ mix
    rtn = fake_quantize(w, 4, 64)
    for act_order in (False, True):
        q, zeros, scales, g_idx = quantize_gptq(w, hessian(x), bits=4, group_size=64, act_order=act_order)
        gptq = dequantize(q, zeros, scales, g_idx)
        assert _output_error(x, w, gptq) < 0.5 * _output_error(x, w, rtn)
    assert sorted(g_idx.tolist()) == group_index(256, 64).tolist()


def test_gptq_rounding_of_8bit_channel_weights_keeps_rtn_scales_and_lowers_output_error():
    """--method fp8/int8 --gptq: the per-channel scale is RTN's, every value stays on the 8-bit grid, and the error
    feedback lowers the layer's output error on correlated activations."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 256, generator=g)
    x = (torch.randn(1024, 32, generator=g) @ torch.randn(32, 256, generator=g)
         + 0.1 * torch.randn(1024, 256, generator=g))
    for kind in ("int8", "fp8"):
        q_rtn, scale_rtn = quantize_weight(w, kind)
        for act_order in (False, True):
            q, scale = quantize_gptq_channel(w, hessian(x), kind, act_order=act_order)
            assert q.dtype == q_rtn.dtype and torch.equal(scale, scale_rtn)
            assert torch.equal(round_to_grid(q.float(), kind), q.float())
            gptq_err = _output_error(x, w, dequantize_weight(q, scale))
            assert gptq_err < 0.7 * _output_error(x, w, dequantize_weight(q_rtn, scale_rtn)), (kind, act_order)


def test_awq_has_lower_output_error_than_rtn_with_a_few_large_channels():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=g)
    big = torch.ones(256)
    big[torch.randperm(256, generator=g)[:4]] = 30.0  # a few outlier channels, as after an LLM's norms
    x_calib = torch.randn(512, 256, generator=g) * big
    x_test = torch.randn(512, 256, generator=g) * big
    result = quantize_awq([w[:48], w[48:]], x_calib, bits=4, group_size=64)
    assert result.alpha > 0 and result.scales.shape == (256,)
    gidx = group_index(256, 64)
    awq = torch.cat([dequantize(*layer, gidx) for layer in result.layers]) / result.scales
    rtn = fake_quantize(w, 4, 64)
    assert _output_error(x_test, w, awq) < 0.8 * _output_error(x_test, w, rtn)
