"""GPU tests of the Hopper NVFP4 attention kernel (module ``nvfp4_wgmma``, backend
``wgmma_fp16_nvfp4``, sm_90a only).

The kernel reads the same NVFP4 operands as the mma.sync kernel, as FP16 values (which its
pre-pass, ``quantize_nvfp4_fp16``, writes directly), so this file reruns the kernel-independent
cases of ``test_attention_nvfp4_gpu.py`` on it: the ``module`` fixture below replaces that
file's, whose ``run_kernel`` then runs this kernel on the reference's operands as FP16 values
(``reference.nvfp4_fp16_operands``) in a poisoned workspace (0x7F bytes), into a NaN-poisoned
output with guard rows. Each case: every element
finite, nothing written past the tokens, relative L2 <= 0.02 against the reference emulation and
SPEC 5's NVFP4 bars against the FP32 oracle (Gaussian inputs, default scale). Shapes: 1, 15-17,
127-129, 1000, 4096, 16,384 tokens, packed segments with empty ones, 40 x 17 tokens, 1-56 heads,
biased and heavy-tailed inputs, two more softmax scales; execution: determinism, a side stream,
CUDA-graph capture replayed on new operands, no tokens.

Added here: the module's pre-pass against the codes of the mma.sync backend's pre-pass (its FP16
operands are those codes decoded, in the window key order, bit for bit: what the separate
expansion pass used to write), the bindings' argument checks, the public operator's auto backend
on 9.0 through the whole call path, and one segment of 163,840 tokens at 2 heads (FP32 oracle on
sampled rows, reference emulation on sampled query blocks: other low-precision kernels have been
reported to turn to noise there).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_attention_nvfp4_gpu import (  # noqa: F401  (collected again, on this kernel)
    DEFAULT_SCALE,
    _prepared,
    bounds_of,
    cosine,
    make_qkv,
    rel_l2,
    test_56_heads,
    test_cuda_graph_capture_and_replay,
    test_deterministic_and_side_stream,
    test_no_tokens_launches_nothing,
    test_packed,
    test_real_model_like_inputs,
    test_single_segment,
    test_single_segment_16384,
    test_softmax_scale,
)

from flashinfer_h3 import reference as R
from flashinfer_h3.benchtools import sampled_oracle
from flashinfer_h3.plan import build_host_plan

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    from flashinfer_h3.jit import get_module

    return get_module("nvfp4_wgmma")


@pytest.mark.parametrize("kind", ["gauss", "biased", "heavy", "tiny"])
def test_prepass_writes_the_decoded_codes(module: Any, kind: str) -> None:
    """quantize_nvfp4_fp16 (this module's pre-pass) in a poisoned workspace: its means and FP16
    operands pass the pre-pass tests' checks (test_quantize_gpu.check_call: bit-exact against
    the reference given its means, the zero padding, nothing written past vkey_start[S]), and
    its FP16 values are the mma.sync backend's pre-pass codes (module nvfp4, quantize_nvfp4) on
    the same inputs, decoded and put in the window order, bit for bit."""
    from test_quantize_gpu import check_call, run_quantize

    from flashinfer_h3.jit import get_module

    lengths = [0, 100, 1, 17, 64, 129, 0, 300]
    bounds = bounds_of(lengths)
    q, k, v = make_qkv(bounds[-1], 3, kind, seed=41)
    views, ws, layout, host = run_quantize(module, "nvfp4_fp16", q, k, v, bounds)
    check_call("nvfp4_fp16", views, ws, layout, host, q, k, v)
    codes, _, _, _ = run_quantize(get_module("nvfp4"), "nvfp4", q, k, v, bounds)
    want = R.nvfp4_fp16_operands(R.trim_stages("nvfp4", codes, bounds), bounds)
    used = host.vkey_start[-1]
    got = {"q_f16": views["q_f16"], "k_f16": views["k_f16"][:, :used],
           "v_f16": views["v_f16"][..., :used]}
    for name, value in want.items():
        assert torch.equal(got[name].view(torch.int16), value.view(torch.int16)), name


def test_argument_checks(module: Any) -> None:
    prep = _prepared(module, [40], 2, seed=3)
    v, t = prep.views, prep.tables
    used = build_host_plan(prep.bounds).vkey_start[-1]
    out = torch.empty(40, 2, 128, dtype=torch.bfloat16, device="cuda")
    fp16 = (v["q_f16"], v["k_f16"], v["v_f16"])
    args = [v["qbar"], *fp16, t["seg_bounds"], t["vkey_start"], t["qblock_start"], t["qblocks"],
            v["item_counter"]]
    with pytest.raises(ValueError, match="out"):
        module.attention_nvfp4_wgmma(out.float(), *args, DEFAULT_SCALE, used)
    with pytest.raises(ValueError, match="softmax_scale"):
        module.attention_nvfp4_wgmma(out, *args, -1.0, used)
    with pytest.raises(ValueError, match="vkeys_used"):
        module.attention_nvfp4_wgmma(out, *args, DEFAULT_SCALE, used + 1)
    with pytest.raises(ValueError, match="_f16 must have shape"):
        bad = list(args)
        bad[2] = bad[2][:, :-64]
        module.attention_nvfp4_wgmma(out, *bad, DEFAULT_SCALE, used)
    with pytest.raises(ValueError, match="CUDA"):
        bad = list(args)
        bad[-2] = bad[-2].cpu()
        module.attention_nvfp4_wgmma(out, *bad, DEFAULT_SCALE, used)
    with pytest.raises(ValueError, match="item_counter"):
        bad = list(args)
        bad[-1] = bad[-1].float()
        module.attention_nvfp4_wgmma(out, *bad, DEFAULT_SCALE, used)
    q, k, vv = make_qkv(40, 2, "gauss", 3)
    with pytest.raises(ValueError, match="k_f16 must have shape"):
        module.quantize_nvfp4_fp16(q, k, vv, t["seg_bounds"], t["vkey_start"], t["qblock_start"],
                                   t["qblocks"], v["kbar"], v["qbar"], v["q_f16"],
                                   v["k_f16"][:1], v["v_f16"])
    assert not hasattr(module, "expand_nvfp4_fp16") and not hasattr(module, "quantize_nvfp4")


def test_public_operator_auto_backend(module: Any) -> None:
    """On 9.0 the NVFP4 operator's auto backend is this kernel, through the whole call path (the
    pre-pass writing the FP16 operands, the kernel): it agrees with the reference and with the
    emulated mma.sync kernel (selected explicitly), and leaves its inputs unchanged."""
    from flashinfer_h3 import backends, use_backend, varlen_attention_nvfp4

    dev = torch.device("cuda", torch.cuda.current_device())
    auto = backends.resolve("nvfp4", torch.cuda.get_device_capability(dev))
    assert auto.name == "wgmma_fp16_nvfp4"
    bounds = [0, 700, 700, 1033, 1034]
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 31)
    before = [x.clone() for x in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out = varlen_attention_nvfp4(q, k, v, cu)
    with use_backend("nvfp4", "mma_sync_fp4_emulated"):
        emulated = varlen_attention_nvfp4(q, k, v, cu)
    torch.cuda.synchronize()
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x, y), "an input was modified"
    ref = R.varlen_attention_nvfp4_reference(q, k, v, bounds)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= 0.02
    assert rel_l2(out, emulated) <= 0.02


LONG_TOKENS = 163_840  # >= 160,000 (the long-segment case), 1,280 query blocks


def test_one_very_long_segment(module: Any) -> None:
    from flashinfer_h3 import varlen_attention_nvfp4

    heads = 2
    bounds = [0, LONG_TOKENS]
    q, k, v = make_qkv(LONG_TOKENS, heads, "gauss", 160)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out = varlen_attention_nvfp4(q, k, v, cu, cu_seqlens_host=bounds)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()

    oracle = sampled_oracle(q, k, v, bounds, seed=1, rows_per_segment=512)
    got, want = out.index_select(0, oracle.rows.cuda()), oracle.out.cuda()
    e_or, cos = rel_l2(got, want), cosine(got, want)
    # Query blocks at the start, the middle and the end (the last holds every key's last tile).
    blocks = [0, 1, 333, 640, 1000, LONG_TOKENS // 128 - 1]
    stages = R.nvfp4_quantize_stages(q, k, v, bounds)
    ref = R.nvfp4_attention_from_stages(stages, bounds, query_blocks=blocks)
    rows = torch.cat([torch.arange(128 * g, 128 * (g + 1), device="cuda") for g in blocks])
    e_ref = rel_l2(out[rows], ref[rows])
    print(f"[nvfp4 wgmma] one segment of {LONG_TOKENS} tokens x {heads} heads: rel_l2 vs oracle "
          f"{e_or:.4f} (512 rows), cos {cos:.5f}; vs reference {e_ref:.4f} ({len(blocks)} blocks)")
    assert e_ref <= 0.02
    assert e_or <= 0.21 and cos >= 0.975
    assert not math.isnan(e_or)
