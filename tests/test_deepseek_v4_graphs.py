"""DeepSeek V4 CUDA graphs (kvserve/model/deepseek_v4/graphs.py): the padded
static-buffer forward that a graph replays equals the plain eager forward.

Every step here runs on a storage that is NaN outside the pages its
sequences own (filled with a random past as the V4 managers lay them out),
and every static buffer is filled with garbage before the step is loaded:
sequence ids of real sequences, real block ids, random positions. A row the
load left unwritten would then read or write a real page, and the outputs or
the storage after the step would differ from the eager run's.

The capture-state test is the bug class of vLLM PR 41665 (an initialisation
behind a branch skipped at capture): the graph is captured in a state where
every such branch would be skipped (batch full, no window closing, no
compressed entry visible) and replayed where each matters (padding rows,
windows closing, more entries than the indexer keeps).

On the CPU the static path runs eagerly under TRITON_INTERPRET=1 (in a
subprocess, as the kernel tests); on a GPU (`gpu`) the same checks capture
and replay real graphs, and the whole engine with graphs matches the CPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.cache.v4_specs import v4_kv_layout
from kvserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from tests.triton_interpreter import run_interpreted

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
# Capture state: a full batch of 4 at positions that close no window and see no entry.
CAPTURE_SEQS = [(0, 1), (1, 1), (2, 1), (1, 1)]
# Replay state: 3 of 4 rows (one padding row), every token closing CSA and HCA
# windows, up to 10 CSA entries visible (top-2 chosen by the radix select).
REPLAY_SEQS = [(23, 1), (15, 1), (39, 1)]
# Decode and mixed steps (prefill chunks splitting windows beside decodes).
PADDED_STEPS = [[(21, 1), (3, 1), (34, 1)], [(0, 5), (6, 3), (21, 1)], [(60, 1), (7, 6)]]


def save_tiny(path: Path) -> Path:
    """CSA, HCA and sliding layers; 16 indexer heads (no score ties between
    batch sizes' rounding: the engine comparisons are token for token)."""
    from tests.v4_tiny import tiny_v4_model
    tiny_v4_model([CSA, HCA, SLIDING], index_n_heads=16).save_pretrained(path)
    return path


def tiny_model(path: Path, device: str):
    from kvserve.model.deepseek_v4.loader import load_deepseek_v4
    return load_deepseek_v4(str(save_tiny(path)), torch.float32, device)


class Steps:
    """Steps of random sequences on one NaN-filled storage, each step's pages
    in blocks of its own, with the random past a PagedCase fills."""

    def __init__(self, model, storage: torch.Tensor, gen: torch.Generator) -> None:
        self.config, self.storage, self.gen = model.config, storage, gen
        self.layout = v4_kv_layout(self.config, BLOCK_SIZE)
        self.next_block = 1
        storage.fill_(float("nan"))

    def make(self, seqs: list[tuple[int, int]]):
        from kvserve.model.deepseek_v4.graphs import V4Step
        from tests.test_deepseek_v4_kernels import PagedCase
        case = PagedCase(self.config, seqs, BLOCK_SIZE, torch.float32, "cpu", self.gen)
        for layer, kind in enumerate(self.config.layer_types):
            case.fill_tokens("sliding", layer, upto_new=False)
            prefix = {CSA: "csa", HCA: "hca"}.get(kind)
            if prefix:
                case.fill_tokens(f"{prefix}_state", layer, upto_new=False)
                case.fill_entries(f"{prefix}_entries", layer, upto_new=False)
        count, first, device = case.storage.shape[0] - 1, self.next_block, self.storage.device
        self.storage[first:first + count] = case.storage[1:].to(device)
        self.next_block += count
        tables = [torch.where(t > 0, t + first - 1, 0).to(device) for t in case.tables]
        ids = torch.randint(0, self.config.vocab_size, (case.batch.num_tokens,), generator=self.gen)
        return V4Step(ids.to(device), case.batch.positions.to(device), case.batch.seq_idx.to(device), tables,
                      len(seqs), case.batch.max_seq_len)


def poison(graphs, num_seqs: int, gen: torch.Generator) -> None:
    """Garbage in every static buffer: real sequence and block ids, random positions."""
    static = graphs.static
    num_blocks = graphs.batches[graphs.keys()[0]].storage.shape[0]
    for buf, high in ((static.input_ids, 128), (static.positions, 200), (static.seq_idx, num_seqs),
                      (static.block_tables, num_blocks)):
        buf.copy_(torch.randint(0, high, buf.shape, generator=gen))


def eager(model, layout, storage: torch.Tensor, step) -> torch.Tensor:
    from kvserve.model.deepseek_v4.kernels import V4PagedBatch
    batch = V4PagedBatch(storage, layout, step.block_tables, step.seq_idx, step.positions, step.max_seq_len)
    with torch.inference_mode():
        return model.forward_tokens(step.input_ids, step.positions, [], [], batch)


def check_same(graphs, model, runner, step, gen: torch.Generator) -> None:
    """graphs.run(step) = the eager forward, outputs and storage (NaN = NaN)."""
    reference = runner.kv_storage.clone()
    expected = eager(model, runner.layout.kv, reference, step)
    key = graphs.bucket_for(step)
    poison(graphs, step.num_seqs, gen)
    got = graphs.run(step, key)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # Padding rows wrote nothing: every page (and the null block) as the eager step left it.
    torch.testing.assert_close(runner.kv_storage, reference, rtol=1e-4, atol=1e-5, equal_nan=True)


def make_runner(model, device: str, num_blocks: int = NUM_BLOCKS):
    from kvserve.model.deepseek_v4.engine import V4Layout, V4Runner
    layout = V4Layout(v4_kv_layout(model.config, BLOCK_SIZE), num_blocks, torch.float32)
    return V4Runner(model, layout, torch.device(device), 0, "triton")


def check_capture_state(path: Path, device: str, capture: bool) -> None:
    """Capture (or first run) at CAPTURE_SEQS, then REPLAY_SEQS through the same graph."""
    gen = torch.Generator().manual_seed(0)
    model = tiny_model(path, device)
    runner = make_runner(model, device)
    graphs = runner.static_graphs(64, 4, 4, sizes=[4], bounds=[64])
    steps = Steps(model, runner.kv_storage, gen)
    first, second = steps.make(CAPTURE_SEQS), steps.make(REPLAY_SEQS)
    key = graphs.bucket_for(first)
    assert key == graphs.bucket_for(second) == (4, 64)
    graphs.static.load(first, 4, 64 // BLOCK_SIZE)  # the state the graph is captured in
    if capture:
        assert graphs.host_sync_reason() is None
        graphs.capture(torch.cuda.graph_pool_handle(), [key])
    else:
        graphs.run(first, key)
    check_same(graphs, model, runner, second, gen)
    assert graphs.num_replays.get(key, 0) == (1 if capture else 0)


def check_padded_steps(path: Path, device: str, capture: bool) -> None:
    """Decode and mixed steps, padded to a larger bucket, in two context buckets."""
    gen = torch.Generator().manual_seed(1)
    model = tiny_model(path, device)
    runner = make_runner(model, device)
    graphs = runner.static_graphs(96, 8, 16, sizes=[4, 16], bounds=[48, 96])
    if capture:
        graphs.capture(torch.cuda.graph_pool_handle())
    steps = Steps(model, runner.kv_storage, gen)
    for seqs in PADDED_STEPS:
        step = steps.make(seqs)
        assert graphs.bucket_for(step)[0] > step.num_tokens  # padded
        check_same(graphs, model, runner, step, gen)
    assert graphs.num_static_forwards == (0 if capture else len(PADDED_STEPS))


def _engine_tokens(path: Path, device: str, backend: str, graphs: str | None, prompts, **kwargs):
    """Greedy tokens of the engine; graphs "static" runs every step it can through
    the static path without capture, "captured" is the engine's default on CUDA."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    llm = LLM(str(path), device=device, dtype="float32", max_model_len=160, block_size=BLOCK_SIZE,
              attention_backend=backend, enforce_eager=graphs is None, **kwargs)
    runner = llm.engine.runner
    if graphs == "static":
        runner.graphs = runner.static_graphs(160, 4, 13, sizes=[1, 2, 4, 16], bounds=[32, 160])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], runner


def _prompts(lengths, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def check_engine_static_path(path: Path) -> None:
    """The engine with every step it can on the static path = the torch path."""
    save_tiny(path)
    prompts = _prompts((1, 6, 23, 40))
    expected, _ = _engine_tokens(path, "cpu", "torch", None, prompts, max_num_batched_tokens=13)
    got, runner = _engine_tokens(path, "cpu", "triton", "static", prompts, max_num_batched_tokens=13,
                                 max_num_seqs=4)
    assert got == expected
    assert runner.graphs.num_static_forwards > 0 and runner.num_eager_forwards == 0


def interpreter_checks() -> None:
    """Run with TRITON_INTERPRET=1 set before import."""
    import tempfile

    from tests.test_deepseek_v4_kernels import _patch_interpreter_scalar_index
    _patch_interpreter_scalar_index()
    with tempfile.TemporaryDirectory() as tmp:
        check_capture_state(Path(tmp) / "a", "cpu", capture=False)
        check_padded_steps(Path(tmp) / "b", "cpu", capture=False)
        check_engine_static_path(Path(tmp) / "c")


def test_static_path_under_interpreter():
    run_interpreted("import torch; torch.set_num_threads(1); from tests import test_deepseek_v4_graphs as t; "
                    "t.interpreter_checks()", timeout=600, fp_fusion=True)


def test_capture_sizes_and_buckets():
    from kvserve.model.deepseek_v4.graphs import MAX_GRAPH_TOKENS, capture_sizes, context_buckets
    decode = capture_sizes(256, 8192, mixed=False)
    assert decode[:5] == [1, 2, 4, 8, 16] and decode[-1] == 256 and all(b - a <= 8 for a, b in zip(decode, decode[1:]))
    mixed = capture_sizes(256, 8192, mixed=True)
    assert set(decode) < set(mixed) and mixed[-1] == MAX_GRAPH_TOKENS
    assert capture_sizes(4, 13, mixed=True) == [1, 2, 4, 13] and capture_sizes(300, 100, mixed=False)[-1] == 100
    assert context_buckets(160) == [160] and context_buckets(131072) == [8192, 131072]


def test_bucket_choice(tmp_path):
    """Smallest holding bucket; steps over the largest token bucket, context bound
    or sequence capacity, and mixed steps of decode-only graphs, run eagerly."""
    from kvserve.model.deepseek_v4.graphs import V4Graphs, V4Step
    model = tiny_model(tmp_path, "cpu")
    layout = v4_kv_layout(model.config, BLOCK_SIZE)
    storage = torch.zeros(4, layout.unit)

    def step(tokens: int, seqs: int, longest: int) -> V4Step:
        ids = torch.zeros(tokens, dtype=torch.long)
        return V4Step(ids, ids, ids.int(), [], seqs, longest)
    graphs = V4Graphs(model, storage, layout, [1, 4, 16], [32, 160], max_num_seqs=8, mixed=True)
    assert graphs.bucket_for(step(3, 3, 20)) == (4, 32)
    assert graphs.bucket_for(step(9, 2, 33)) == (16, 160)
    assert graphs.bucket_for(step(17, 2, 20)) is None and graphs.bucket_for(step(4, 4, 161)) is None
    assert graphs.bucket_for(step(12, 9, 20)) is None  # more sequences than the static tables hold
    decode_only = V4Graphs(model, storage, layout, [1, 4, 16], [160], max_num_seqs=8, mixed=False)
    assert decode_only.bucket_for(step(9, 2, 20)) is None and decode_only.bucket_for(step(2, 2, 20)) == (4, 160)
    assert graphs.keys()[0] == (16, 160) and len(graphs.keys()) == 6


# ---- GPU: the same checks with real capture and replay ------------------------------------------

@pytest.mark.gpu
def test_capture_state_gpu(tmp_path):
    check_capture_state(tmp_path, "cuda", capture=True)


@pytest.mark.gpu
def test_padded_steps_gpu(tmp_path):
    check_padded_steps(tmp_path, "cuda", capture=True)


@pytest.mark.gpu
def test_graph_replay_equals_eager_random_gpu(tmp_path):
    """Random batch sizes (decode and mixed) and contexts (up to 900 tokens:
    past the indexer's top-k and split-KV) through graphs captured at start-up
    (all-padding state), each replay against the eager forward."""
    from kvserve.model.deepseek_v4.graphs import capture_sizes
    gen = torch.Generator().manual_seed(2)
    model = tiny_model(tmp_path, "cuda")
    runner = make_runner(model, "cuda", 120_000)
    graphs = runner.static_graphs(1024, 24, 64, sizes=capture_sizes(24, 64, mixed=True), bounds=[128, 1024])
    assert graphs.host_sync_reason() is None
    graphs.capture(torch.cuda.graph_pool_handle())
    steps = Steps(model, runner.kv_storage, gen)
    for trial in range(12):
        num_seqs = int(torch.randint(1, 25, (), generator=gen))
        mixed = trial % 3 == 2
        news = [int(torch.randint(1, 5, (), generator=gen)) if mixed else 1 for _ in range(num_seqs)]
        limit = 120 if trial % 2 else 1000
        seqs = [(int(torch.randint(0, limit - n, (), generator=gen)), n) for n in news]
        step = steps.make(seqs)
        if graphs.bucket_for(step) is None:
            continue
        check_same(graphs, model, runner, step, gen)
    assert sum(graphs.num_replays.values()) >= 8 and graphs.num_static_forwards == 0


@pytest.mark.gpu
def test_engine_with_graphs_matches_cpu(tmp_path):
    """The whole engine on CUDA with graphs (decode and mixed steps replayed)
    = the CPU torch path, greedy, token for token."""
    save_tiny(tmp_path)
    prompts = _prompts((1, 6, 23, 70))
    expected, _ = _engine_tokens(tmp_path, "cpu", "torch", None, prompts, max_num_batched_tokens=13)
    got, runner = _engine_tokens(tmp_path, "cuda", "triton", "captured", prompts, max_num_batched_tokens=13,
                                 max_num_seqs=4, kv_cache_memory_gb=1)
    assert runner.graphs is not None, "graphs were not captured (see the warning: a host sync in the forward?)"
    assert got == expected
    replayed = {size for (size, _), n in runner.graphs.num_replays.items() if n}
    assert any(size <= 4 for size in replayed) and any(size > 4 for size in replayed)  # decode and mixed
