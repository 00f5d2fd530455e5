"""The tensor-core W4A16 path (kernels/triton_w4a16_tc.py, under the Triton interpreter on CPU): the load-time repack
into its layout is lossless for every 4-bit checkpoint layout; the kernel matches the reference on the checkpoint's
tensors for AWQ, GPTQ, GPTQ act-order and compressed-tensors pack in fp16 and fp32 (the interpreter's bf16 dot is
wrong), with masked tails in M, N and K, groups of 32 to per-channel, split-K summed in the kernel (the same bits on
every call) or by a second kernel; the PTX unpack the GPU runs, emulated instruction by instruction, gives the
interpreter path's values; the dispatch table is data, and the committed one keeps today's paths; a layer repacks once
at load when the table says so and still equals dequantize-then-linear."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import json  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import triton_ops, triton_w4a16, triton_w4a16_tc, w4a16_dispatch, w4a16_ref  # noqa: E402
from vserve.kernels.w4a16_repack import act_order_perm, repack, tc_group_size  # noqa: E402
from vserve.quantize.formats import pack_awq, pack_gptq, pack_int32  # noqa: E402
from vserve.quantize.rtn import quantize_rtn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-3)}


def checkpoint(layout: str, N: int, K: int, group: int) -> tuple:
    """Random 4-bit checkpoint tensors of one [N, K] weight: (qweight, scales, qzeros, g_idx, layout name, group);
    layout gptq-act: a shuffled g_idx (any codes: each column reads its group's scale and zero)."""
    w = torch.randn(N, K) * 0.05
    if layout == "awq":
        qweight, qzeros, scales = pack_awq(*quantize_rtn(w, 4, group))
        return qweight, scales, qzeros, None, "awq", group
    if layout.startswith("gptq"):
        q, zeros, scales = quantize_rtn(w, 4, group)
        g_idx = torch.arange(K, dtype=torch.int32) // group
        if layout == "gptq-act":
            g_idx = g_idx[torch.randperm(K)]
            q = torch.randint(0, 16, (N, K), dtype=torch.int32)
        qweight, qzeros, scales, g = pack_gptq(q, zeros, scales, g_idx, 4)
        return qweight, scales, qzeros, g if layout == "gptq-act" else None, "gptq", group
    scales = torch.rand(N, -(-K // group)) * 0.01 + 1e-3  # pack: symmetric, fp32 scales [N, groups]
    return pack_int32(torch.randint(0, 16, (N, K), dtype=torch.int32), 4), scales, None, None, "pack", group


def _close(actual, expected, dtype, seed):
    torch.testing.assert_close(actual, expected.to(actual.dtype), **TOL[dtype],
                               msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")


@pytest.mark.parametrize("layout,N,K,group", [
    ("awq", 40, 256, 64), ("awq", 24, 384, 128), ("gptq", 24, 320, 32),  # K = 2.5 tiles
    ("gptq-act", 16, 256, 32), ("gptq-act", 24, 320, 64), ("pack", 20, 256, 128),  # N = 20: zeros padded
    ("pack", 8, 136, 136),
])
def test_repack_is_lossless(seed, layout, N, K, group):
    """The tc layout holds the checkpoint's codes, zeros and scales exactly: dequantized, the same W (act-order: K
    sorted by group at load, put back by perm); the bytes are the checkpoint's where 128 divides K."""
    qweight, scales, qzeros, g_idx, kind, gs = checkpoint(layout, N, K, group)
    ref = w4a16_ref.dequantize_weight(qweight, scales, qzeros, g_idx, kind, 4, gs)
    tq, ts, tz, perm, tgs = repack(qweight, scales, qzeros, g_idx, kind, 4, gs, K, N)
    assert torch.equal(w4a16_ref.dequantize_weight(tq, ts, tz, perm, "tc", 4, tgs, K), ref), seed
    if perm is not None:
        assert torch.equal(g_idx[perm.long()], torch.sort(g_idx).values)  # groups contiguous after the sort
    if K % 128 == 0 and N % 8 == 0:
        held = [t for t in (qweight, scales, qzeros, g_idx) if t is not None]
        repacked = [t for t in (tq, ts, tz, perm) if t is not None]
        assert sum(t.numel() * t.element_size() for t in held) == sum(t.numel() * t.element_size() for t in repacked)


def test_act_order_slices_of_uneven_groups_are_not_repacked():
    """A row-parallel rank's slice of an act-order layer has groups of uneven sizes: no tc layout for it."""
    g_idx = (torch.arange(256, dtype=torch.int32) // 32)[torch.randperm(256)]
    assert act_order_perm(g_idx, 32) is not None
    assert act_order_perm(g_idx[:128], 32) is None
    assert [tc_group_size(g, 256) for g in (8, 16, 32, 48, 64, 128, 192, 256, 1000)] == \
        [None, 16, 32, None, 64, 128, None, 256, 256]


CASES = [  # layout, N, K, group, M, launch: masked tails in M (5, 17, 33 of 16/32-row tiles), N (40 of 32) and K
    ("awq", 40, 256, 128, 5, dict(block_n=32, block_m=16, split_k=1)),
    ("awq", 40, 384, 64, 17, dict(block_n=32, block_m=16, split_k=3)),  # 3 splits of one tile, groups of 64
    ("awq", 40, 384, 128, 17, dict(block_n=32, block_m=16, split_k=2, scale_a=True)),  # scales on the weights
    ("gptq", 24, 320, 32, 3, dict(block_n=16, block_m=16, split_k=2, scale_a=True)),  # K tail: 2.5 tiles, group 32
    ("gptq-act", 24, 320, 64, 33, dict(block_n=16, block_m=32, split_k=2)),  # act-order: x read through perm
    ("gptq-act", 32, 256, 128, 2, dict(block_n=32, block_m=16, split_k=2, scale_a=True)),
    ("pack", 20, 200, 200, 17, dict(block_n=16, block_m=32, split_k=2)),  # per-channel, K tail in the only group
    # wide: the tile's 8 fields joined into one K = 128 operand (groups of 128 and up)
    ("awq", 40, 384, 128, 17, dict(block_n=32, block_m=16, split_k=2, wide=True)),
    ("gptq-act", 32, 256, 128, 33, dict(block_n=32, block_m=32, split_k=1, scale_a=True, wide=True)),
    ("pack", 20, 200, 200, 5, dict(block_n=16, block_m=16, split_k=1, wide=True)),  # K tail
]


@pytest.mark.parametrize("layout,N,K,group,M,launch", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tc_gemm_matches_the_checkpoint_reference(seed, layout, N, K, group, M, launch, dtype):
    """w4a16_gemm on the repacked tensors (layout "tc") = w4a16_gemm_ref on the checkpoint's, with the K-split
    partials summed by the kernel's last program per output tile (every arrival count back at 0, the same bits on a
    second call) or by a second kernel."""
    qweight, scales, qzeros, g_idx, kind, gs = checkpoint(layout, N, K, group)
    tq, ts, tz, perm, tgs = repack(qweight, scales, qzeros, g_idx, kind, 4, gs, K, N)
    x = torch.randn(M, K).to(dtype)
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, kind, 4, gs)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    got = triton_w4a16.w4a16_gemm(x, tq, ts, tz, perm, "tc", 4, tgs, out=out, path="tc", num_warps=4, num_stages=2,
                                  **launch)
    assert got is out
    _close(got, ref, dtype, seed)
    assert int(triton_ops.arrival_counts(x.device, 1).abs().sum()) == 0
    assert torch.equal(got, triton_w4a16.w4a16_gemm(x, tq, ts, tz, perm, "tc", 4, tgs, path="tc", **launch))
    two_kernels = triton_w4a16.w4a16_gemm(x, tq, ts, tz, perm, "tc", 4, tgs, path="tc", fixup=False, **launch)
    _close(two_kernels, ref, dtype, seed)
    # the reference computes from the repacked layout as well
    _close(w4a16_ref.w4a16_gemm_ref(x, tq, ts, tz, perm, "tc", 4, tgs), ref, dtype, seed)


@pytest.mark.parametrize("sdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N", [20, 21])
def test_16_bit_scales_read_as_int32_words_or_as_stored(seed, sdtype, N):
    """fp16 and bf16 scales with an even row length are read as int32 words (each output takes its half: the load
    the GPU's software pipeline prefetches), with an odd one as stored; both equal the reference on those scales,
    with the scales applied to the dot's sums and on the weights."""
    qweight, scales, qzeros, g_idx, kind, gs = checkpoint("pack", N, 256, 128)
    tq, ts, tz, perm, tgs = repack(qweight, scales, qzeros, g_idx, kind, 4, gs, 256, N)
    ts = ts.to(sdtype)
    assert triton_w4a16_tc._scale_words(ts) == (0 if N % 2 else 1 if sdtype == torch.float16 else 2)
    x = torch.randn(5, 256)
    ref = w4a16_ref.w4a16_gemm_ref(x, tq, ts, tz, perm, "tc", 4, tgs)
    for launch in (dict(scale_a=False), dict(scale_a=True, wide=True)):
        out = torch.full((5, N), float("nan"))
        triton_w4a16_tc.tc_gemm(x, tq, ts, tz, perm, tgs, out, block_n=16, block_m=16, split_k=2, num_warps=4,
                                num_stages=2, **launch)
        _close(out, ref, torch.float32, seed)


@pytest.mark.parametrize("layout", ["awq", "gptq-act"])
def test_no_masks_along_n_where_the_tile_divides_n_gives_the_same_bits(seed, layout):
    """EVEN_N (tc_gemm's even_n, on by default): where block_n divides N the kernel drops its masks along N; the
    output is the masked kernel's, bit for bit, for the unscaled, scaled and wide launches and split-K; where
    block_n does not divide N (40 over 16) the masks stay and the result still equals the reference."""
    for N in (32, 40):
        qweight, scales, qzeros, g_idx, kind, gs = checkpoint(layout, N, 256, 128)
        tq, ts, tz, perm, tgs = repack(qweight, scales, qzeros, g_idx, kind, 4, gs, 256, N)
        x = torch.randn(5, 256)
        ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, kind, 4, gs)
        for launch in (dict(scale_a=False, split_k=2), dict(scale_a=True, wide=True, split_k=1)):
            outs = []
            for even_n in (True, False):
                out = torch.full((5, N), float("nan"))
                triton_w4a16_tc.tc_gemm(x, tq, ts, tz, perm, tgs, out, block_n=16, block_m=16, num_warps=4,
                                        num_stages=2, even_n=even_n, **launch)
                _close(out, ref, torch.float32, seed)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (N, launch)


@pytest.mark.parametrize("layout", ["awq", "gptq-act"])
def test_the_tc_layouts_dequantize_path_matches_the_reference(seed, layout):
    """Path "dequant" on the tc layout: the weight dequantized (in the repacked K order) into the shared buffer, x's
    columns through act-order's perm, then cuBLAS (here torch.matmul)."""
    qweight, scales, qzeros, g_idx, kind, gs = checkpoint(layout, 48, 384, 64)
    tq, ts, tz, perm, tgs = repack(qweight, scales, qzeros, g_idx, kind, 4, gs, 384, 48)
    x = torch.randn(3, 7, 384, dtype=torch.float16)  # leading dims kept
    got = triton_w4a16.w4a16_gemm(x, tq, ts, tz, perm, "tc", 4, tgs, path="dequant")
    assert got.shape == (3, 7, 48)
    _close(got, w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, kind, 4, gs), torch.float16, seed)


def test_default_launch_configs_fill_the_gpu_and_run():
    """tc_default_config (shapes without a tuned entry): 128 outputs a program, rows up to 128 a tile, K split while
    the programs do not fill 132 SMs twice (each split keeping >= 2 K tiles, the partials' bytes <= the weight's)."""
    cfg = triton_w4a16_tc.tc_default_config
    assert cfg(1, 4096, 4096, 132) == dict(block_n=128, block_m=16, split_k=16, num_warps=4, num_stages=3,
                                           scale_a=False)
    assert cfg(8, 28672, 4096, 132)["split_k"] == 2
    assert cfg(256, 4096, 14336, 132) == dict(block_n=128, block_m=128, split_k=2, num_warps=4, num_stages=3,
                                              scale_a=True)
    assert cfg(128, 6144, 4096, 132)["split_k"] == 2 and cfg(4096, 28672, 4096, 132)["split_k"] == 1


# ---- the PTX unpack, emulated ------------------------------------------------------------------------------------


def _run_ptx(asm: str, regs: dict) -> dict:
    """Execute the instructions _unpack_asm emits (mov, prmt, lop3 with LUT 0xEA, or, shr, packed fma) on 32-bit
    registers, as PTX defines them."""
    env = dict(regs)

    def val(tok):
        return int(tok, 16) if tok.startswith("0x") else env[tok]

    def halves(v, dt):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dt).float()

    for ins in filter(None, (i.strip() for i in asm.strip()[1:-1].split(";"))):
        op, rest = ins.split(None, 1)
        a = [t.strip() for t in rest.split(",")]
        if op == ".reg":
            continue
        if op == "mov.b32":
            env[a[0]] = val(a[1])
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i) of {b, a}
            src, sel = val(a[1]) | val(a[2]) << 32, val(a[3])
            env[a[0]] = sum(((src >> 8 * ((sel >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "lop3.b32":
            assert val(a[4]) == 0xEA  # (a & b) | c
            env[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "or.b32":
            env[a[0]] = val(a[1]) | val(a[2])
        elif op == "shr.b32":  # logical
            env[a[0]] = val(a[1]) >> int(a[2])
        else:
            dt = {"fma.rn.bf16x2": torch.bfloat16, "fma.rn.f16x2": torch.float16}[op]
            r = (halves(val(a[1]), dt) * halves(val(a[2]), dt) + halves(val(a[3]), dt)).to(dt)
            h = r.view(torch.int16).to(torch.int32) & 0xFFFF
            env[a[0]] = int(h[0]) | int(h[1]) << 16
    return env


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_ptx_unpack_gives_each_field_minus_its_zero(dtype):
    """_unpack_asm's PTX (what the GPU runs; the interpreter runs Triton integer ops): two words and their zeros in,
    output j = the pair (field j of word a - z_a, field j of word b - z_b), exact, a's in the low half (element 0 of
    Triton's packed pair); with a pair of scales, times them, rounded once."""
    rng = random.Random(0)
    for scaled in (False, True):
        asm = triton_w4a16_tc._unpack_asm(dtype == torch.bfloat16, scaled)
        for _ in range(32):
            wa, wb, za, zb = rng.getrandbits(32), rng.getrandbits(32), rng.randrange(16), rng.randrange(16)
            s = torch.rand(2).to(dtype) if scaled else torch.ones(2, dtype=dtype)
            s_pair = s.view(torch.int16).to(torch.int32) & 0xFFFF
            env = _run_ptx(asm, {"$8": wa, "$9": wb, "$10": za, "$11": zb, "$12": int(s_pair[0] | s_pair[1] << 16)})
            for j in range(8):
                pair = torch.tensor([env[f"${j}"] & 0xFFFF, env[f"${j}"] >> 16], dtype=torch.int32).to(torch.int16)
                expected = (torch.tensor([((wa >> 4 * j) & 15) - za, ((wb >> 4 * j) & 15) - zb]) * s.float()).to(dtype)
                assert torch.equal(pair.view(dtype), expected), (j, wa, wb, scaled)


# ---- the dispatch table ------------------------------------------------------------------------------------------


@pytest.fixture
def table_file(tmp_path, monkeypatch):
    """write(table) -> the dispatch table VSERVE_W4A16_CONFIGS points at (read again; the committed one after)."""
    def write(t: dict):
        path = tmp_path / "w4a16_configs.json"
        path.write_text(json.dumps(t))
        monkeypatch.setenv("VSERVE_W4A16_CONFIGS", str(path))
        w4a16_dispatch.reload()
        return path

    yield write
    monkeypatch.delenv("VSERVE_W4A16_CONFIGS", raising=False)
    w4a16_dispatch.reload()


def test_the_committed_table_keeps_todays_paths_where_untuned():
    """The CPU and devices without tuned entries repack nothing and take today's thresholds ("auto"); the tuned
    device's entries are valid, name measured times and serve every row count."""
    w4a16_dispatch.reload()
    t = w4a16_dispatch.table()
    assert t["default"] == {"layout": "checkpoint"} and "cpu" not in t["devices"]
    for M in (1, 8, 256, 4096):
        assert w4a16_dispatch.choose(torch.device("cpu"), 4096, 4096, M) == ("auto", {})
    assert w4a16_dispatch.layout_for(torch.device("cpu"), 28672, 4096) == "checkpoint"
    assert w4a16_dispatch.entry("NVIDIA B200", 4096, 4096, t) == {"layout": "checkpoint"}
    for dev, d in t["devices"].items():
        if "same_as" in d:  # an untuned GPU of a tuned one's architecture takes its entries
            assert w4a16_dispatch.entry(dev, 4096, 4096, t) == w4a16_dispatch.entry(d["same_as"], 4096, 4096, t)
        for shape, e in d.get("shapes", {}).items():
            assert e["layout"] == "tc" and "1" in e["rows"], (dev, shape)
            for m, row in e["rows"].items():  # each row was the faster of its measured tc and dequant paths
                ms = row["_ms"]
                assert ms[row["path"]] == min(ms["tc"], ms["dequant"]), (dev, shape, m)
                assert row["path"] == "dequant" or {"block_n", "block_m", "split_k"} <= set(row), (dev, shape, m)


def test_rows_serve_from_their_key_to_the_next_and_bad_tables_are_named(table_file):
    table_file({"default": {"layout": "checkpoint"}, "devices": {"cpu": {"shapes": {"N=64,K=256": {
        "layout": "tc", "rows": {"2": {"path": "tc", "block_m": 16, "split_k": 4}, "64": {"path": "dequant"}}}}}}})
    cpu = torch.device("cpu")
    assert w4a16_dispatch.layout_for(cpu, 64, 256) == "tc" and w4a16_dispatch.layout_for(cpu, 64, 512) == "checkpoint"
    assert [w4a16_dispatch.choose(cpu, 64, 256, M)[0] for M in (1, 2, 63, 64, 5000)] == ["tc", "tc", "tc", "dequant",
                                                                                          "dequant"]
    assert w4a16_dispatch.choose(cpu, 64, 256, 3) == ("tc", {"block_m": 16, "split_k": 4})
    table_file({"devices": {"cpu": {"same_as": "NVIDIA H100"}}})
    with pytest.raises(ValueError, match=r"devices\['cpu'\].same_as = 'NVIDIA H100': it must name another device"):
        w4a16_dispatch.table()
    table_file({"default": {"layout": "tc", "rows": {"1": {"path": "auto"}}}})
    with pytest.raises(ValueError, match=r"rows\['1'\].*paths for layout tc are tc, dequant"):
        w4a16_dispatch.table()
    table_file({"default": {"layout": "marlin"}})
    with pytest.raises(ValueError, match="layout must be one of checkpoint, tc, got 'marlin'"):
        w4a16_dispatch.table()


def test_a_device_named_same_as_takes_the_others_entries_where_it_has_none(table_file):
    """same_as: the device's own shapes first, then the named device's, then the own default, the named device's
    default, the global default; a same_as that names no device, itself, or a device that borrows too is refused."""
    tuned = {"layout": "tc", "rows": {"1": {"path": "tc", "block_m": 16}}}
    own = {"layout": "tc", "rows": {"1": {"path": "dequant"}}}
    table_file({"default": {"layout": "checkpoint"}, "devices": {
        "cpu": {"same_as": "GPU A", "shapes": {"N=64,K=512": own}},
        "GPU A": {"shapes": {"N=64,K=256": tuned, "N=64,K=512": tuned}, "default": {"layout": "tc"}}}})
    cpu = torch.device("cpu")
    assert w4a16_dispatch.choose(cpu, 64, 256, 1) == ("tc", {"block_m": 16})      # GPU A's shape
    assert w4a16_dispatch.choose(cpu, 64, 512, 1) == ("dequant", {})               # its own shape wins
    assert w4a16_dispatch.layout_for(cpu, 128, 128) == "tc"                        # GPU A's default
    for bad in ({"cpu": {"same_as": "cpu"}},
                {"cpu": {"same_as": "GPU A"}, "GPU A": {"same_as": "GPU B"}, "GPU B": {}}):
        table_file({"devices": bad})
        with pytest.raises(ValueError, match="same_as"):
            w4a16_dispatch.table()


def test_a_layer_repacks_once_at_load_where_the_table_says(table_file):
    """GroupQuantMethod.process_weights_after_loading: with the table's layout "tc" for this device and shape the
    layer's tensors become the tc layout (same bytes), and the layer still equals dequantize-then-linear; a shape the
    table leaves on "checkpoint" keeps the checkpoint's tensors."""
    from vserve.core.layers.linear import Linear
    from vserve.core.layers.quantization import from_hf

    qc = from_hf({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True})
    table_file({"devices": {"cpu": {"shapes": {"N=48,K=128": {"layout": "tc"}}}}})
    layers = {}
    for n in (48, 40):
        torch.manual_seed(0)
        layer = Linear(128, n, parallel="column", quant_config=qc, prefix="model.layers.0.mlp.down_proj")
        qweight, scales, qzeros, g_idx, _, _ = checkpoint("gptq-act", n, 128, 32)
        for name, t in dict(qweight=qweight, scales=scales, qzeros=qzeros, g_idx=g_idx).items():
            layer.weight_loader(dict(layer.named_parameters())[name], t)
        w = w4a16_ref.dequantize_weight(qweight, scales, qzeros, g_idx, "gptq", 4, 32)
        held = sum(p.numel() * p.element_size() for p in layer.parameters())
        layer.quant_method.process_weights_after_loading(layer)
        assert sum(p.numel() * p.element_size() for p in layer.parameters()) == held
        x = torch.randn(5, 128)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
        layers[n] = layer
    assert layers[48].quant_method.layout == "tc" and {"qweight", "scales", "qzeros", "perm"} == \
        {name for name, _ in layers[48].named_parameters()}
    assert layers[40].quant_method.layout == "gptq" and hasattr(layers[40], "g_idx")


def test_the_warm_up_runs_each_tc_weight_kind_once_at_every_row_key(table_file, monkeypatch):
    """warm_up_w4a16 (the model runner's start on a GPU): one GEMM per table row key for each distinct tc-layout
    weight kind; a second weight of the same kind and a weight left on the checkpoint layout run none."""
    from vserve.core.layers.linear import Linear
    from vserve.core.layers.quantization import GroupQuantMethod, from_hf, warm_up_w4a16

    qc = from_hf({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True})
    table_file({"devices": {"cpu": {"shapes": {"N=48,K=128": {"layout": "tc", "rows": {
        "1": {"path": "tc", "block_m": 16, "split_k": 2}, "16": {"path": "tc", "block_m": 32},
        "64": {"path": "dequant"}}}}}}})
    model = torch.nn.Sequential(*(Linear(128, n, parallel="column", quant_config=qc,
                                         prefix=f"model.layers.{i}.o_proj") for i, n in enumerate((48, 48, 40))))
    for layer in model:
        qweight, scales, qzeros, _, _, _ = checkpoint("awq", layer.out_features, 128, 32)
        for name, t in dict(qweight=qweight, scales=scales, qzeros=qzeros).items():
            layer.weight_loader(dict(layer.named_parameters())[name], t)
        layer.quant_method.process_weights_after_loading(layer)
    assert [layer.quant_method.layout for layer in model] == ["tc", "tc", "awq"]
    runs, apply = [], GroupQuantMethod.apply

    def counted(self, layer, x, bias):
        y = apply(self, layer, x, bias)
        runs.append((layer.out_features, x.shape[0], tuple(y.shape)))
        return y

    monkeypatch.setattr(GroupQuantMethod, "apply", counted)
    assert warm_up_w4a16(model, torch.float32, torch.device("cpu")) == 3
    assert runs == [(48, 1, (1, 48)), (48, 16, (16, 48)), (48, 64, (64, 48))]


def test_the_benchmark_script_runs_on_cpu(tmp_path):
    """benchmarks/kernels/w4a16_tc.py --cpu-smoke: its check, compare, tune and profile launches on a tiny shape under
    the interpreter (the numbers mean nothing), writing its JSON, its markdown table and a dispatch table the loader
    accepts."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "w4a16_tc.py"
    res = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (tmp_path / "w4a16_tc.md").read_text().count("| 256x64 |") == 2
    tuned = w4a16_dispatch.table(str(tmp_path / "w4a16_configs.json"))
    assert set(tuned["devices"]["cpu"]["shapes"]["N=64,K=256"]["rows"]) == {"1", "5"}
    profiled = json.loads((tmp_path / "w4a16_tc.json").read_text())["profile"]  # what run.sh w4ncu hands to ncu
    assert [(r["M"], r["what"].split(" (")[0]) for r in profiled] == [
        (m, w) for m in (1, 5) for w in ("defaults", "launch 0", "cuBLAS bf16")]
    assert not any("error" in r for r in profiled)
