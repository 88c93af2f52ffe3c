"""Table and PNG of a serve_load.sh rate sweep: TTFT p99 and ITL p95 against
request rate, one line per engine, from the `--save-json` files of a folder.

Usage: python benchmarks/plot_serve_load.py DIR [WORKLOAD] [OUT.png] [MACHINES]
MACHINES names where the runs went in the title ("one H200" unless given).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, workload: str) -> dict[str, list[tuple[float, dict]]]:
    runs: dict[str, list[tuple[float, dict]]] = {}
    for path in folder.glob(f"*_{workload}_*.json"):
        engine = path.name.split("_", 1)[0]
        data = json.loads(path.read_text())
        runs.setdefault(engine, []).append((float(data["args"]["request_rate"]), data["summary"]))
    return {e: sorted(r, key=lambda x: x[0]) for e, r in sorted(runs.items())}


def table(runs: dict[str, list[tuple[float, dict]]]) -> str:
    lines = ["| engine | rate | req/s | TTFT mean / p99 ms | ITL p50 / p95 ms | E2E p50 ms |",
             "|---|---|---|---|---|---|"]
    for engine, rows in runs.items():
        for rate, s in rows:
            lines.append(f"| {engine} | {rate:g} | {s['request_throughput']:.1f} | "
                         f"{s['ttft_ms']['mean']:.1f} / {s['ttft_ms']['p99']:.1f} | "
                         f"{s['itl_ms']['median']:.1f} / {s['itl_ms']['p95']:.1f} | {s['e2e_ms']['median']:.0f} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[tuple[float, dict]]], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for engine, rows in runs.items():
        rates = [r for r, _ in rows]
        axes[0].plot(rates, [s["ttft_ms"]["p99"] for _, s in rows], marker="o", label=engine)
        axes[1].plot(rates, [s["itl_ms"]["p95"] for _, s in rows], marker="o", label=engine)
    for ax, name in zip(axes, ("TTFT p99 (ms)", "ITL p95 (ms)")):
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(folder: str, workload: str = "ide-completion", out: str | None = None,
         machines: str = "one H200") -> None:
    runs = load(Path(folder), workload)
    print(table(runs))
    if out:
        plot(runs, out, f"{workload}: streaming /v1/completions, token-id prompts, {machines}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
