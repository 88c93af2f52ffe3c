"""The fused V4 glue kernels (kernels/mhc.py, norm_rope.py, router.py) against
the torch code they replace on the kernel path (layers.hc_pre + RMSNorm,
layers.hc_merge, layers.RMSNorm / unweighted_rms_norm + rope.apply_rope,
layers.Gate.forward), and the launch budget of a decode step.

Every check draws fresh random inputs and runs with torch.empty / empty_like
poisoned (NaN floats, -7 ints), so an output element a kernel leaves
unwritten fails. float32 must match to 1e-5 relative, half types to 1e-2.
On the CPU, small shapes run under TRITON_INTERPRET=1 in a subprocess, in
float32 and float16 (the interpreter rounds bf16 by truncation); on a GPU
(`gpu`), V4-Flash shapes in bf16 and float32.
"""
from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch

from kvserve.model.deepseek_v4.loader import dummy_config
from tests.triton_interpreter import run_interpreted

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty / empty_like return NaN (floats) or -7 (ints) while active."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, expected.shape, out.dtype)
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned)"
    diff = (out.float() - expected.float()).norm()
    return float(diff / expected.float().norm().clamp_min(1e-30))


def _flash(shape: str, **overrides):
    """"tiny": small dims, 4 streams, 20 Sinkhorn iterations; "flash": V4-Flash's dims."""
    if shape == "tiny":
        return dummy_config("tiny-deepseek-v4", {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hidden_size": 96}
                            | overrides)
    return dummy_config("deepseek-v4-flash", overrides)


# ---- mHC ------------------------------------------------------------------------------------------

def check_hc(shape: str, num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """hc_pre_norm = hc_pre + RMSNorm; mhc.hc_merge = layers.hc_merge."""
    from kvserve.model.deepseek_v4.kernels import mhc
    from kvserve.model.deepseek_v4.layers import RMSNorm, hc_merge, hc_pre
    config = _flash(shape)
    hc, dim = config.hc_mult, config.hidden_size
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(num_tokens, hc, dim, generator=g).to(device, dtype)
    fn = (torch.randn((2 + hc) * hc, hc * dim, generator=g) * (hc * dim) ** -0.5).to(device)
    base, scale = torch.randn((2 + hc) * hc, generator=g).to(device), (torch.rand(3, generator=g) + 0.5).to(device)
    norm = RMSNorm(dim, config.rms_norm_eps).to(device)
    norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(device)
    block_out = torch.randn(num_tokens, dim, generator=g).to(device, dtype)
    with torch.no_grad():
        post, comb, x = hc_pre(streams, fn, base, scale, config)
        x, merged = norm(x), hc_merge(streams, block_out, post, comb)
        with poisoned_allocations():
            got = mhc.hc_pre_norm(streams, fn, base, scale, norm.weight, norm.eps, config)
            got_merged = mhc.hc_merge(streams, block_out, post, comb)
    for name, out, expected in zip(("post", "comb", "input"), got, (post, comb, x)):
        tol = TOL[torch.float32] * 10 if out.dtype == torch.float32 else TOL[dtype]
        assert rel_err(out, expected) < tol, (name, shape, num_tokens, dtype, rel_err(out, expected))
    assert rel_err(got_merged, merged) < TOL[dtype], ("merge", shape, num_tokens, dtype)
    assert torch.allclose(got[1].sum(-2), torch.ones_like(got[1].sum(-2)), atol=1e-3)  # Sinkhorn: columns sum to 1


# ---- norms and rope -------------------------------------------------------------------------------

def check_norm_rope(shape: str, num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """Each use on the kernel path against its torch composition."""
    from kvserve.model.deepseek_v4.kernels.norm_rope import UNWEIGHTED, WEIGHTED, norm_rope, rms_norm
    from kvserve.model.deepseek_v4.layers import RMSNorm, unweighted_rms_norm
    from kvserve.model.deepseek_v4.rope import V4Rope, apply_rope
    config = _flash(shape)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, config.max_position_embeddings, (num_tokens,), generator=g).to(device)
    rope = V4Rope(config)
    rope.freqs = {k: f.to(device) for k, f in rope.freqs.items()}
    cos, sin = rope.cos_sin("compress", positions, dtype)
    heads, dim = config.num_attention_heads, config.head_dim
    q = (3 * torch.randn(num_tokens, heads, dim, generator=g)).to(device, dtype)
    norm = RMSNorm(dim, config.rms_norm_eps).to(device)
    norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(device)
    lora = RMSNorm(config.q_lora_rank, config.rms_norm_eps).to(device)
    lora.weight.data = (1 + 0.3 * torch.randn(config.q_lora_rank, generator=g)).to(device)
    kv = torch.randn(num_tokens, dim, generator=g).to(device, dtype)
    q_res = torch.randn(num_tokens, config.q_lora_rank, generator=g).to(device, dtype)
    idx = torch.randn(num_tokens, config.index_n_heads, config.index_head_dim, generator=g).to(device, dtype)
    eps = config.rms_norm_eps
    with torch.no_grad(), poisoned_allocations():
        cases = {
            "q": (norm_rope(q, cos, sin, UNWEIGHTED, eps=eps), apply_rope(unweighted_rms_norm(q, eps), cos, sin)),
            "kv": (norm_rope(kv, cos, sin, WEIGHTED, norm.weight, eps), apply_rope(norm(kv), cos, sin)),
            "out": (norm_rope(q, cos, sin, inverse=True), apply_rope(q, cos, -sin)),
            "indexer q": (norm_rope(idx, cos, sin), apply_rope(idx, cos, sin)),
            "q lora": (rms_norm(q_res, lora.weight, eps), lora(q_res)),
        }
    for name, (out, expected) in cases.items():
        assert rel_err(out, expected) < TOL[dtype], (name, shape, num_tokens, dtype, rel_err(out, expected))


# ---- router ---------------------------------------------------------------------------------------

def check_router(shape: str, num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """Gate.forward_fused = Gate.forward (same experts; weights per expert), for
    every scoring function, top-k and hash layers."""
    from kvserve.model.deepseek_v4.layers import Gate
    for func in ("sqrtsoftplus", "sigmoid", "softmax"):
        overrides = {"scoring_func": func} | ({"n_routed_experts": 24, "num_experts_per_tok": 6}
                                              if shape == "tiny" else {"n_routed_experts": 32})
        config = _flash(shape, **overrides)
        g = torch.Generator().manual_seed(seed)
        for is_hash in (False, True):
            gate = _random_gate(Gate(config, is_hash), config, g).to(device)
            gate.weight.data = gate.weight.data.to(dtype)
            x = torch.randn(num_tokens, config.hidden_size, generator=g).to(device, dtype)
            ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=g).to(device)
            with torch.no_grad():
                weights, indices = gate(x, ids)
                with poisoned_allocations():
                    got_weights, got_indices = gate.forward_fused(x, ids)
            order, got_order = indices.sort(1), got_indices.sort(1)
            assert torch.equal(order.values, got_order.values), (func, is_hash, "experts differ")
            err = rel_err(got_weights.gather(1, got_order.indices), weights.gather(1, order.indices))
            assert err < TOL[dtype], (func, is_hash, dtype, err)


def _random_gate(gate, config, g: torch.Generator):
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * config.hidden_size ** -0.5)
        if gate.is_hash:
            gate.tid2eid.copy_(torch.randint(0, config.n_routed_experts, gate.tid2eid.shape, generator=g))
        else:
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=g) * 0.1)
    return gate


# ---- launches of a decode step --------------------------------------------------------------------

def decode_launches_per_layer() -> tuple[float, collections.Counter]:
    """Device launches (non-view aten ops + Triton kernel launches) of one batch-1
    decode step of the paged (Triton, CUDA-graph) forward of a V4-Flash-l8-shaped
    model (flash layer types, 4 streams, 20 Sinkhorn iterations, top-6 of 32
    experts; small widths), per layer, and by function of kvserve/model/deepseek_v4.
    Run under TRITON_INTERPRET=1 in bf16 (the GPU path's casts are all there)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    from kvserve.model.deepseek_v4.loader import _build, _fill_dummy
    from tests.test_deepseek_v4_kernels import PagedCase, _patch_interpreter_scalar_index
    _patch_interpreter_scalar_index()
    config = dummy_config("deepseek-v4-flash-l8", {
        "hidden_size": 128, "vocab_size": 256, "moe_intermediate_size": 32, "num_attention_heads": 8,
        "head_dim": 128, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16, "q_lora_rank": 64,
        "o_lora_rank": 64})
    model = _build(config, torch.bfloat16, "cpu")
    _fill_dummy(model, 0)
    for layer in model.layers:
        layer.ffn.backend = "triton"
    case = PagedCase(config, [(300, 1)], 16, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    case.storage.normal_()
    counts, inside = collections.Counter(), [False]
    skip = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
            torch.ops.aten.empty_strided.default, torch.ops.aten.detach.default}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and not func.is_view and func not in skip:
                counts[_caller()] += 1
            return func(*args, **(kwargs or {}))

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        counts[_caller()] += 1
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False
    ids = torch.tensor([7])
    with torch.inference_mode():
        model.forward_tokens(ids, case.batch.positions, [], [], case.batch)  # first-call imports outside the count
        interpreter.InterpretedFunction.run = counted_run
        try:
            with Counter():
                model.forward_tokens(ids, case.batch.positions, [], [], case.batch)
        finally:
            interpreter.InterpretedFunction.run = run
    return sum(counts.values()) / config.num_hidden_layers, counts


def _caller() -> str:
    """The innermost kvserve/model/deepseek_v4 function on the stack ("module.py:qualname")."""
    root = "/kvserve/model/deepseek_v4/"
    frame = sys._getframe(2)
    while frame is not None and root not in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename.split(root)[1]}:{frame.f_code.co_qualname}"


def print_launch_table() -> None:
    """python -c "from tests import test_deepseek_v4_fused as t; t.print_launch_table()" with TRITON_INTERPRET=1."""
    per_layer, counts = decode_launches_per_layer()
    print(f"{sum(counts.values())} launches per step, {per_layer:.1f} per layer\n")
    print("| function | launches / step |\n|---|---:|")
    for name, n in counts.most_common():
        print(f"| {name} | {n} |")


# ---- CPU: under the interpreter -------------------------------------------------------------------

def interpreter_checks() -> None:
    for dtype in (torch.float32, torch.float16):
        for num_tokens, seed in ((1, 0), (5, 1)):
            check_hc("tiny", num_tokens, dtype, "cpu", seed)
            check_norm_rope("tiny", num_tokens, dtype, "cpu", seed)
            check_router("tiny", num_tokens, dtype, "cpu", seed)
    per_layer, counts = decode_launches_per_layer()
    # 426 per layer on the GPU before the fusions (382 by this count); 44 after.
    assert per_layer < 60, (per_layer, counts.most_common(8))
    print(f"launches per layer: {per_layer:.1f}")


def test_fused_kernels_under_interpreter():
    out = run_interpreted("import torch; torch.set_num_threads(1); from tests import test_deepseek_v4_fused as t; "
                          "t.interpreter_checks()", timeout=300)
    assert "launches per layer" in out


# ---- GPU: V4-Flash shapes -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fused_kernels_flash_gpu(dtype, num_tokens):
    check_hc("flash", num_tokens, dtype, "cuda", num_tokens)
    check_norm_rope("flash", num_tokens, dtype, "cuda", num_tokens)
    check_router("flash", num_tokens, dtype, "cuda", num_tokens)


@pytest.mark.gpu
def test_fused_kernels_graph_replay_gpu():
    """hc_pre_norm, hc_merge, norm_rope and the router captured once and replayed
    on fresh inputs copied into the static buffers give eager's outputs."""
    from kvserve.model.deepseek_v4.kernels import mhc
    from kvserve.model.deepseek_v4.kernels.norm_rope import UNWEIGHTED, norm_rope
    from kvserve.model.deepseek_v4.kernels.router import route_tokens
    config = _flash("flash", n_routed_experts=32)
    hc, dim, E = config.hc_mult, config.hidden_size, config.n_routed_experts
    fn = torch.randn((2 + hc) * hc, hc * dim, device="cuda") * (hc * dim) ** -0.5
    base, scale, weight = torch.randn((2 + hc) * hc, device="cuda"), torch.ones(3, device="cuda"), torch.ones(
        dim, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.1

    def inputs(seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(4, hc, dim, device="cuda", generator=g).bfloat16(),
                torch.randn(4, 8, 512, device="cuda", generator=g).bfloat16(),
                torch.randn(4, E, device="cuda", generator=g).bfloat16(),
                torch.randn(4, 32, device="cuda", generator=g).bfloat16())

    def step(streams, q, logits, cs):
        post, comb, x = mhc.hc_pre_norm(streams, fn, base, scale, weight, 1e-6, config)
        return (mhc.hc_merge(streams, x, post, comb), norm_rope(q, cs, cs, UNWEIGHTED, eps=1e-6),
                *route_tokens(logits, "sqrtsoftplus", 6, 1.5, bias=bias))
    static = inputs(0)
    step(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*static)
    for seed in (1, 2):
        fresh = inputs(seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        for got, expected in zip(outputs, step(*fresh)):
            assert torch.equal(got, expected), seed
