"""The Gluon sparse decode kernel's place in V4 attention (kvserve/model/deepseek_v4/kernels/
sparse_decode_gluon.py): which launches the default configs give it, what `sparse_attention`
hands it, the Triton kernel where it fails to build, how many dim parts (programs a token) it
launches; and on a Hopper GPU (`gpu`), the kernel itself against the float32 reference, padding
tokens and chosen lists of every length included, in one dim part or two, eagerly and replayed
from a CUDA graph."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import triton

from kvserve.model.deepseek_v4.kernels.pages import PageRef

# the package exports a function of the module's name: the modules by path
attention = importlib.import_module("kvserve.model.deepseek_v4.kernels.sparse_attention")
gluon = importlib.import_module("kvserve.model.deepseek_v4.kernels.sparse_decode_gluon")
REAL_SUPPORTS = gluon.supports


@pytest.fixture
def gluon_state(monkeypatch):
    """The kernel's build state restored after each test (a test may switch it off)."""
    monkeypatch.setitem(gluon._BROKEN, "reason", None)
    return gluon


def test_default_configs_take_the_gluon_kernel_unless_switched_off(gluon_state, monkeypatch):
    monkeypatch.setenv(gluon.ENV, "0")
    assert not attention.default_config(256, 640).gluon
    monkeypatch.delenv(gluon.ENV, raising=False)
    assert attention.default_config(256, 640) is attention.GLUON_CONFIG
    monkeypatch.setenv(gluon.ENV, "1")
    for num_tokens in (8, 63, 64):   # from 8 tokens it beats the Triton kernel's splits
        assert attention.default_config(num_tokens, 640) is attention.GLUON_CONFIG
    assert not attention.default_config(7, 640).gluon   # fewer: Triton's splits, faster in a graph
    assert attention.default_config(1 << 16, 640) is attention.PREFILL_CONFIG      # a plan too large: prefill
    assert attention.GLUON_CONFIG.planned   # its fallback where the kernel does not serve: the planned one
    monkeypatch.setenv(gluon.ENV, "on")
    with pytest.raises(ValueError, match="KVSERVE_GLUON_SPARSE must be 0 or 1, got 'on'"):
        attention.default_config(256, 640)


def _launch(monkeypatch, kernel):
    """sparse_attention on CPU tensors with the Gluon kernel claimed supported and both Triton
    launches and the plan replaced by recorders: what each would have been handed."""
    calls = {"triton": 0, "plan": []}
    plan = torch.arange(4 * 640, dtype=torch.int64).reshape(4, 640)

    def fake_plan(*args):
        calls["plan"].append(args[-2])   # row_align
        return plan
    monkeypatch.setattr(attention, "_plan", fake_plan)
    monkeypatch.setattr(gluon, "supports", lambda *a: True)
    monkeypatch.setattr(gluon, "sparse_decode_gluon", kernel)

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls["triton"] += 1
            return run
    monkeypatch.setattr(attention, "_sparse_attention_kernel", Launch())
    q = torch.randn(4, 64, 512)
    table = torch.zeros(4, 8, dtype=torch.int32)
    batch = SimpleNamespace(num_tokens=4, max_seq_len=4096, storage=torch.zeros(64, 1024), block_size=16,
                            seq_idx=torch.arange(4, dtype=torch.int32), positions=torch.full((4,), 4095))
    sinks, out = torch.zeros(64), torch.empty_like(q)
    indices = torch.zeros(4, 512, dtype=torch.int32)
    result = attention.sparse_attention(q, PageRef(table, 0, 16, 512), PageRef(table, 512, 16, 512), indices,
                                        sinks, 0.5, 128, 4, batch, out, attention.GLUON_CONFIG)
    return calls, plan, result, out


def test_the_gluon_kernel_gets_the_plan_and_the_log2_scale(gluon_state, monkeypatch):
    seen = []
    calls, plan, result, out = _launch(monkeypatch, lambda *args: seen.append(args))
    (q, storage, got_plan, row_align, sinks, qk_scale, got_out), = seen
    assert got_plan is plan and got_out is out and result is out
    assert row_align == calls["plan"][0] == 16   # the plan's unit is the kernel's row unit
    assert qk_scale == pytest.approx(0.5 * attention.LOG2E)
    assert calls["triton"] == 0


def test_a_gluon_kernel_that_fails_to_build_hands_over_to_triton(gluon_state, monkeypatch, caplog):
    def broken(*args):
        raise triton.compiler.errors.CompilationError("src", None, "no thread_barrier in this Gluon")
    calls, _, result, out = _launch(monkeypatch, broken)
    assert calls["triton"] == 1 and result is out
    assert gluon._BROKEN["reason"] is not None and "switched off" in caplog.text
    # a switched-off kernel serves nothing: `supports` answers before looking at the launch
    assert REAL_SUPPORTS(None, None, None, 640, 16) is False


@pytest.mark.parametrize("num_tokens, parts", [(1, 2), (64, 2), (66, 2), (67, 1), (256, 1)])
def test_dim_parts_while_two_programs_a_token_fit_one_wave(gluon_state, monkeypatch, num_tokens, parts):
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 1 << 30)
    assert gluon.dim_parts(num_tokens, 132) == parts
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 32)   # the threshold bounds it below the wave's
    assert gluon.dim_parts(num_tokens, 132) == (2 if num_tokens <= 32 else 1)


def test_dim_parts_threshold_zero_means_one_part_and_the_forced_count_wins(gluon_state, monkeypatch):
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 0)
    assert [gluon.dim_parts(n, 132) for n in (1, 2, 64, 66, 256)] == [1] * 5
    monkeypatch.setattr(gluon, "DIM_PARTS_FORCED", 2)
    assert gluon.dim_parts(256, 132) == 2
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 1 << 30)
    monkeypatch.setattr(gluon, "DIM_PARTS_FORCED", 1)
    assert gluon.dim_parts(1, 132) == 1


def test_dim_parts_set_the_grid_and_the_kernels_parts(gluon_state, monkeypatch):
    """`parts` None: the rule for the token count (a CPU device counts 4 SMs); else as given."""
    launches = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw["PARTS"]))
    monkeypatch.setattr(gluon, "_sparse_decode_kernel", Launch())
    q, out = torch.zeros(3, 64, 512), torch.zeros(3, 64, 512)

    def launch(tokens, **kw):
        plan = torch.full((tokens, 640), -1, dtype=torch.int64)
        gluon.sparse_decode_gluon(q[:tokens], None, plan, 16, None, 1.0, out[:tokens], **kw)
        return launches.pop()
    assert launch(2) == ((4, ), 2)   # the default threshold: 2 tokens x 2 programs fit 4 SMs
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 0)
    assert launch(2) == ((2, ), 1)   # DIM_PARTS_MAX_TOKENS 0: one part
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 1 << 30)
    assert launch(3) == ((3, ), 1)   # 6 programs would not
    assert launch(3, parts=2) == ((6, ), 2) and launch(2, parts=1) == ((2, ), 1)


# ----------------------------------------------------------------------------- GPU (Hopper)

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _reference(q, storage, plan, row_align, sinks, scale):
    """float32 softmax over each token's valid plan rows plus the sink (a logit, zero value)."""
    flat = storage.reshape(-1).float()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        ids = plan[t][plan[t] >= 0]
        if ids.numel() == 0:
            continue
        rows = flat[(ids[:, None] * row_align + torch.arange(512, device=q.device)).reshape(-1)].reshape(-1, 512)
        logits = torch.cat([q[t].float() @ rows.T * scale, sinks[:, None]], dim=1)
        out[t] = logits.softmax(dim=1)[:, :-1] @ rows
    return out


def _problem(tokens: int, row_align: int, max_keys: int, seed: int):
    """Fresh random q, keys in a storage larger than L2 (64 MB of rows), sinks, and a plan whose
    valid counts start 0 (a padding token), 1, a tile's edge and all keys (as many of those as
    there are tokens), then random; plan ids in production's storage offset unit."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 1 << 16
    storage = torch.randn(rows * 512 // row_align + 512, row_align, device="cuda", generator=gen).bfloat16()
    q = (torch.randn(tokens, 64, 512, device="cuda", generator=gen) * (8 / 512) ** 0.5).bfloat16()
    sinks = torch.randn(64, device="cuda", generator=gen)
    counts = [0, 1, 63, 64, 65, max_keys] + torch.randint(0, max_keys + 1, (max(tokens - 6, 0),), generator=gen,
                                                          device="cuda").tolist()
    plan = torch.full((tokens, max_keys), -1, dtype=torch.int64, device="cuda")
    for t, n in enumerate(counts[:tokens]):
        plan[t, :n] = torch.randint(0, rows, (n,), generator=gen, device="cuda") * (512 // row_align)
    return q, storage, plan, sinks


def _run(q, storage, plan, row_align, sinks, **kw):
    """The kernel on NaN-poisoned output (a row it skips shows), checked finite."""
    out = torch.full_like(q, float("nan"))
    assert gluon.supports(q, storage, out, plan.shape[1], row_align)
    gluon.sparse_decode_gluon(q, storage, plan, row_align, sinks, 512 ** -0.5 * attention.LOG2E, out, **kw)
    assert torch.isfinite(out).all()
    return out


def _rel_err(out, expected):
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel is built for Hopper (sm_90)")
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("variant", [(64, 2), (32, 4)], ids=["n64st2", "n32st4"])
@pytest.mark.parametrize("row_align, max_keys", [(16, 640), (8, 1152), (16, 2048)])
def test_gluon_sparse_decode_matches_float32(row_align, max_keys, variant, parts):
    """37 tokens, random valid counts (0, 1, a tile's edge, all), NaN-poisoned output; every
    variant the probe times (ring slot size and depth), in one dim part and in two."""
    q, storage, plan, sinks = _problem(37, row_align, max_keys, row_align + max_keys)
    out = _run(q, storage, plan, row_align, sinks, block_n=variant[0], stages=variant[1], parts=parts)
    assert (out[0] == 0).all()   # a token without keys: zeros
    err = _rel_err(out, _reference(q, storage, plan, row_align, sinks, 512 ** -0.5))
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel is built for Hopper (sm_90)")
@pytest.mark.parametrize("tokens", [1, 37, 67])
def test_two_dim_parts_match_one_part(tokens):
    """Each program of two dim parts stores its own half of the output dims: the result is one
    part's up to the order of S's sums (part 1 reads the dims rotated), not a merged softmax."""
    q, storage, plan, sinks = _problem(max(tokens, 6), 16, 704, tokens)
    if tokens == 1:   # a lone token of 65 keys, not a multiple of BLOCK_N
        q, plan = q[4:5], plan[4:5]
    one, two = _run(q, storage, plan, 16, sinks, parts=1), _run(q, storage, plan, 16, sinks, parts=2)
    expected = _reference(q, storage, plan, 16, sinks, 512 ** -0.5)
    assert _rel_err(two, expected) < 1e-2 and _rel_err(one, expected) < 1e-2
    assert _rel_err(two, one) < 1e-3
    if tokens > 1:
        assert (two[0] == 0).all()   # the padding token


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel is built for Hopper (sm_90)")
def test_dim_parts_replay_from_a_cuda_graph(gluon_state, monkeypatch):
    """The rule's two parts (shapes only) captured as the engine captures decode, then replayed
    on new queries and plans written into the captured buffers: one part's result, eagerly."""
    from kvserve.runner.cuda_graph import capture_graph
    monkeypatch.setattr(gluon, "DIM_PARTS_MAX_TOKENS", 1 << 30)
    assert gluon.dim_parts(9, gluon.sm_count(torch.device("cuda"))) == 2
    q, storage, plan, sinks = _problem(9, 16, 640, 1)
    out = torch.empty_like(q)

    def run():
        return gluon.sparse_decode_gluon(q, storage, plan, 16, sinks, 512 ** -0.5 * attention.LOG2E, out)
    graph, _ = capture_graph(run, None, torch.cuda.Stream())
    new_q, _, new_plan, _ = _problem(9, 16, 640, 2)
    q.copy_(new_q)
    plan.copy_(new_plan.roll(1, 0))   # the padding token moves: row 1
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert (out[1] == 0).all()
    assert _rel_err(out, _run(q, storage, plan, 16, sinks, parts=1)) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel is built for Hopper (sm_90)")
@pytest.mark.parametrize("forced_parts", [None, 2], ids=["rule", "parts2"])
@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_v4_attention_runs_the_gluon_kernel_and_matches_the_reference(kind, forced_parts, monkeypatch):
    """Through `sparse_attention` with V4-Flash heads, against the torch reference the Triton
    kernels are tested with; the kernel must actually have run (a spy counts its launches); with
    the module's default dim parts and with two parts forced (`v4_kernel_bench.py`'s switch)."""
    from tests import test_deepseek_v4_kernels as t
    monkeypatch.setattr(gluon, "DIM_PARTS_FORCED", forced_parts)
    launches = []
    real = gluon.sparse_decode_gluon
    monkeypatch.setattr(gluon, "sparse_decode_gluon", lambda *a: launches.append(1) or real(*a))
    layer_kind = {"csa": t.CSA, "hca": t.HCA, "sliding": t.SLIDING}[kind]
    for block_size in (16, 64):
        err = t.check_attention(layer_kind, t.GPU_DECODES + t.GPU_SEQS, block_size, torch.bfloat16, "cuda",
                                block_size, shape="flash", hca_rate=128, block_n=64, variant={"planned": True,
                                                                                              "gluon": True})
        assert err < t.TOL[torch.bfloat16]
    assert launches
