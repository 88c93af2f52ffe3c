"""Fused elementwise kernels (Triton) against their torch compositions, which
carry HF's exact numerics. GPU tests run on the device; the interpreter test
runs the same kernels on CPU when Triton is installed."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.model import fused_ops


def _check_all(device: str, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x, res, w = rand(37, 256), rand(37, 256), rand(256)
    out, summed = fused_ops._rms_norm_triton(x, res, w, 1e-6)
    ref_sum = x + res
    _close(summed, ref_sum, tol)
    _close(out, fused_ops._rms_norm_torch(ref_sum, w, 1e-6), tol)
    _close(fused_ops._rms_norm_triton(x, None, w, 1e-6)[0], fused_ops._rms_norm_torch(x, w, 1e-6), tol)
    gate_up = rand(37, 2 * 200)
    gate, up = gate_up.split(200, dim=-1)
    got = _silu_triton(gate_up)
    _close(got, torch.nn.functional.silu(gate) * up, tol)
    positions = torch.randint(0, 4000, (37,), generator=g).to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)).to(device)
    for heads, kv_heads in [(8, 2), (6, 3)]:  # 6 and 3: head tiles with masked rows
        _check_qk_norm_rope(rand(37, (heads + 2 * kv_heads) * 64), heads, kv_heads, positions, inv_freq,
                            [(None, None), (rand(64), rand(64))], tol)


def _check_qk_norm_rope(qkv, heads, kv_heads, positions, inv_freq, weight_pairs, tol):
    """In place on views into one q|k|v tensor, as the model calls it: q and k match the
    torch composition, v's columns stay untouched."""
    for weights in weight_pairs:
        packed = qkv.clone()
        q = packed[:, :heads * 64].view(-1, heads, 64)
        k = packed[:, heads * 64:(heads + kv_heads) * 64].view(-1, kv_heads, 64)
        ref_q, ref_k = fused_ops._qk_norm_rope_torch(q.clone(), k.clone(), positions, inv_freq, *weights, 1e-6)
        _qk_triton(q, k, positions, inv_freq, *weights)
        _close(q, ref_q, tol)
        _close(k, ref_k, tol)
        assert torch.equal(packed[:, (heads + kv_heads) * 64:], qkv[:, (heads + kv_heads) * 64:])


def _silu_triton(gate_up):
    half = gate_up.shape[-1] // 2
    out = torch.full((gate_up.shape[0], half), float("nan"), dtype=gate_up.dtype, device=gate_up.device)
    fused_ops._silu_mul_kernel[(gate_up.shape[0], 1)](gate_up, out, gate_up.stride(0), half, BLOCK=256)
    return out


def _qk_triton(q, k, positions, inv_freq, qw, kw):
    fused_ops._qk_norm_rope_triton(q, k, positions, inv_freq, qw, kw, 1e-6)


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(got).any()
    err = (got.double() - ref.double()).norm() / ref.double().norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_ops_match_torch_on_gpu(dtype, tol):
    _check_all("cuda", dtype, tol)


@pytest.mark.skipif(fused_ops.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs under TRITON_INTERPRET=1 with Triton installed")
def test_fused_ops_under_interpreter():
    _check_all("cpu", torch.float32, 1e-5)
