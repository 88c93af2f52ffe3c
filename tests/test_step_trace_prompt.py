"""The step trace's summary of graph mixed steps by the prompt tokens they carry."""
from kvserve.engine import step_trace


def _trace(tmp_path, prompts):
    """Graph mixed steps whose periods are 6 ms + 20 us a prompt token (line i's step is what
    line i + 2 waited for), 24 rows each."""
    starts = [0.0, 5.0]
    for p in prompts[:-2]:
        starts.append(starts[-1] + 6.0 + 0.02 * p)
    body = "".join(f"{t / 1e3}\t1.0\t0.5\t0.1\t24\t{p}\t0\t0.0\t0.0\t0\t0\tnan\n" for t, p in zip(starts, prompts))
    path = tmp_path / "steps.tsv"
    path.write_text(step_trace.HEADER + body)
    return step_trace.read(str(path))


def test_mixed_steps_are_binned_by_prompt_tokens_and_fitted(tmp_path):
    prompts = [16 + (i * 97) % 1900 for i in range(80)]
    steps = _trace(tmp_path, prompts)
    mixed = [s for s in step_trace.with_periods(steps) if step_trace.kind(s) == "mixed/graph"]
    (line,) = step_trace.mixed_by_prompt(mixed)
    assert "fit 6.00 ms + 20.0 us a prompt token" in line
    assert "<=64: " in line and "<=2048: " in line and "<=4096" not in line
    assert line in step_trace.summary(steps)


def test_one_prompt_size_gives_its_bin_without_a_fit(tmp_path):
    steps = _trace(tmp_path, [100] * 6)
    mixed = step_trace.with_periods(steps)
    assert step_trace.mixed_by_prompt(mixed) == ["mixed/graph device ms p50 by prompt tokens: <=128: 8.00 (4)"]
    assert step_trace.mixed_by_prompt([]) == []


def test_a_short_chunks_cost_over_decode_is_binned_by_rows():
    """Decode steps of 20 rows at 6 ms and mixed steps of 20 rows with 16 prompt tokens at 7 ms:
    +1.00 in the 16-31 bin; a longer chunk and a bin with too few steps are left out."""
    def step(rows, prompt, ms):
        return {"rows": rows, "prompt_tokens": prompt, "device_ms": ms}
    decode = [step(20, 0, 6.0)] * 5 + [step(40, 0, 7.0)] * 5
    mixed = [step(20, 16, 7.0)] * 5 + [step(20, 200, 30.0)] * 9 + [step(40, 8, 9.0)] * 4
    assert step_trace.short_chunk_cost(decode, mixed) == [
        "mixed/graph (<= 32 prompt tokens) - decode/graph device ms p50 by rows: 16-31: 7.00 - 6.00 = +1.00"]
    assert step_trace.short_chunk_cost(decode, []) == []
