"""flashinfer_h3.compat on the CPU: how flash_attn_varlen_func / sageattn calls map onto the
operators (mocked: CPU tensors are fine for the mock) and which options raise, naming them."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3 import compat, diffusion_ops
from flashinfer_h3.compat import UnsupportedOptionError, flash_attn_varlen_func, sageattn


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def make(self, name: str):
        def op(q, k, v, cu_seqlens, out=None, *, cu_seqlens_host=None, softmax_scale=None):
            self.calls.append((name, (q, k, v, cu_seqlens),
                               {"cu_seqlens_host": cu_seqlens_host,
                                "softmax_scale": softmax_scale}))
            # A recognisable result: q + 2k + 3v, per token (a function of the packed inputs).
            return (q.float() + 2 * k.float() + 3 * v.float()).to(q.dtype)

        return op


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    for name in ("nvfp4", "fp8"):
        monkeypatch.setattr(diffusion_ops, f"minimax_h3_sm120_varlen_attention_{name}",
                            rec.make(name))
    return rec


def _packed(tokens: int = 10, heads: int = 2):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(tokens, heads, 128, generator=g).bfloat16() for _ in range(3))


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ---------------------------------------------------------------------------------------------


def test_flash_attn_maps_onto_the_nvfp4_operator(ops: Recorder) -> None:
    q, k, v = _packed()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, 0.0, 0.125)
    ((name, (qq, kk, vv, cc), kw),) = ops.calls
    assert name == "nvfp4" and qq is q and kk is k and vv is v and cc is cu
    assert kw == {"cu_seqlens_host": None, "softmax_scale": 0.125}
    assert torch.equal(out, (q.float() + 2 * k.float() + 3 * v.float()).bfloat16())


def test_flash_attn_precision_fp8_host_bounds_and_neutral_options(ops: Recorder) -> None:
    q, k, v = _packed()
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = cu_q.clone()  # equal values in another tensor: compared, accepted
    flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 6, 6, dropout_p=0.0, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=True, return_attn_probs=False,
        block_table=None, precision="fp8", cu_seqlens_host=[0, 4, 10],
    )
    ((name, _, kw),) = ops.calls
    assert name == "fp8" and kw == {"cu_seqlens_host": [0, 4, 10], "softmax_scale": None}


def test_flash_attn_makes_strided_views_contiguous_without_touching_them(ops: Recorder) -> None:
    qkv = torch.randn(10, 3, 2, 128).bfloat16()
    before = qkv.clone()
    q, k, v = qkv.unbind(1)  # slices of a packed qkv: not contiguous
    cu = torch.tensor([0, 10], dtype=torch.int32)
    flash_attn_varlen_func(q, k, v, cu, cu, 10, 10)
    ((_, (qq, kk, vv, _), _),) = ops.calls
    assert all(t.is_contiguous() for t in (qq, kk, vv))
    assert torch.equal(qq, q) and torch.equal(kk, k) and torch.equal(vv, v)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"causal": True}, "causal"),
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"window_size": (128, 0)}, "window_size"),
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.ones(2)}, "alibi_slopes"),
        ({"return_attn_probs": True}, "return_attn_probs"),
        ({"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "block_table"),
        ({"max_seqlen_k": 7}, "max_seqlen_k"),
    ],
)
def test_flash_attn_unsupported_options_name_the_argument(ops: Recorder, kwargs: dict,
                                                          name: str) -> None:
    q, k, v = _packed()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    args = {"max_seqlen_q": 6, "max_seqlen_k": 6, **kwargs}
    with pytest.raises(UnsupportedOptionError, match=rf"flash_attn_varlen_func: {name}="):
        flash_attn_varlen_func(q, k, v, cu, cu, **args)
    assert not ops.calls


def test_flash_attn_rejects_cross_attention_and_gqa(ops: Recorder) -> None:
    q, k, v = _packed()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(UnsupportedOptionError, match="cu_seqlens_k.*differs from cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cu, torch.tensor([0, 5, 10], dtype=torch.int32), 6, 6)
    with pytest.raises(UnsupportedOptionError, match="cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, cu, torch.tensor([0, 10], dtype=torch.int32), 6, 6)
    k1, v1 = k[:, :1].contiguous(), v[:, :1].contiguous()
    with pytest.raises(UnsupportedOptionError, match=r"k=.*GQA/MQA"):
        flash_attn_varlen_func(q, k1, v1, cu, cu, 6, 6)
    with pytest.raises(UnsupportedOptionError, match=r"k=<8 tokens>"):
        flash_attn_varlen_func(q, k[:8], v[:8], cu, cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q=5 is shorter than the longest segment"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, cu_seqlens_host=[0, 4, 10])
    assert not ops.calls


def test_flash_attn_argument_types(ops: Recorder) -> None:
    q, k, v = _packed()
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flash_attn_varlen_func(q, k, v, cu, cu, 10.0, 10)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attn_varlen_func([1], k, v, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="precision must be one of 'nvfp4', 'fp8'"):
        flash_attn_varlen_func(q, k, v, cu, cu, 10, 10, precision="int8")
    with pytest.raises(TypeError):
        flash_attn_varlen_func(q, k, v, cu, cu, 10, 10, seqused_k=None)  # not FA2's
    assert not ops.calls


def test_flash_attn_keeps_flash_attns_positional_order() -> None:
    import inspect

    params = list(inspect.signature(flash_attn_varlen_func).parameters)
    assert params[:16] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
        "deterministic", "return_attn_probs", "block_table",
    ]


# ---------------------------------------------------------------------------------------------
# sageattn
# ---------------------------------------------------------------------------------------------


def _dense(b: int = 2, h: int = 3, n: int = 5, layout: str = "HND"):
    g = torch.Generator().manual_seed(1)
    shape = (b, h, n, 128) if layout == "HND" else (b, n, h, 128)
    return tuple(torch.randn(shape, generator=g).bfloat16() for _ in range(3))


def _expected(q, k, v):
    return (q.float() + 2 * k.float() + 3 * v.float()).bfloat16()


def test_sageattn_nhd_packs_without_a_copy(ops: Recorder) -> None:
    q, k, v = _dense(layout="NHD")
    out = sageattn(q, k, v, tensor_layout="NHD", sm_scale=0.1)
    ((name, (qq, kk, vv, cu), kw),) = ops.calls
    assert name == "nvfp4"
    assert qq.shape == (10, 3, 128) and qq.data_ptr() == q.data_ptr()  # a view
    assert kk.data_ptr() == k.data_ptr() and vv.data_ptr() == v.data_ptr()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 10]
    assert kw == {"cu_seqlens_host": (0, 5, 10), "softmax_scale": 0.1}
    assert out.shape == q.shape and torch.equal(out, _expected(q, k, v))


def test_sageattn_hnd_default_layout(ops: Recorder) -> None:
    q, k, v = _dense(layout="HND")
    before = [t.clone() for t in (q, k, v)]
    out = sageattn(q, k, v, precision="fp8")
    ((name, (qq, _, _, cu), _),) = ops.calls
    assert name == "fp8" and qq.is_contiguous() and qq.shape == (10, 3, 128)
    assert torch.equal(qq.view(2, 5, 3, 128).transpose(1, 2), q)
    assert cu.tolist() == [0, 5, 10]
    assert out.shape == q.shape and torch.equal(out, _expected(q, k, v))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before, strict=True))


def test_sageattn_hnd_view_of_token_major_memory_is_not_copied(ops: Recorder) -> None:
    # A DiT's x.view(B, N, H, D).transpose(1, 2): HND shape, token-major memory.
    q, k, v = (t.transpose(1, 2) for t in _dense(layout="NHD"))
    out = sageattn(q, k, v, tensor_layout="HND")
    ((_, (qq, _, _, _), _),) = ops.calls
    assert qq.data_ptr() == q.data_ptr()
    assert torch.equal(out, _expected(q, k, v))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"is_causal": True}, "is_causal=True"),
        ({"return_lse": True}, "return_lse=True"),
        ({"smooth_k": False}, "unsupported argument.*smooth_k"),
        ({"qk_quant_gran": "per_warp"}, "unsupported argument.*qk_quant_gran"),
        ({"tensor_layout": "BHSD"}, "tensor_layout must be 'HND' or 'NHD'"),
    ],
)
def test_sageattn_unsupported_options(ops: Recorder, kwargs: dict, pattern: str) -> None:
    q, k, v = _dense()
    with pytest.raises(ValueError, match=pattern):
        sageattn(q, k, v, **kwargs)
    assert not ops.calls


def test_sageattn_rejects_cross_attention_gqa_and_bad_ranks(ops: Recorder) -> None:
    q, k, v = _dense()
    with pytest.raises(UnsupportedOptionError, match="k=.*q has 3 heads, k 1.*GQA"):
        sageattn(q, k[:, :1], v[:, :1])
    with pytest.raises(UnsupportedOptionError, match="k=.*equal query and key lengths"):
        sageattn(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seq, heads, dim\]"):
        sageattn(q[0], k[0], v[0], tensor_layout="NHD")
    assert not ops.calls


def test_compat_is_exported_and_documented() -> None:
    assert set(compat.__all__) >= {"flash_attn_varlen_func", "sageattn", "UnsupportedOptionError"}
    assert issubclass(UnsupportedOptionError, ValueError)
