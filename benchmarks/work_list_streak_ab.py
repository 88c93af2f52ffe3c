"""Host us a decode graph replay spends on its work list (`WorkLists.write`) through a 128-step
decode streak (every row one key longer a step), for the kvserve tree given: an A/B of two trees.

    git worktree add /tmp/base BASE
    for t in /tmp/base .; do OMP_NUM_THREADS=1 python benchmarks/work_list_streak_ab.py $t; done
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(sys.argv[1]).resolve()))
sys.path.insert(1, str(Path(__file__).resolve().parent))
from kvserve.runner.cuda_graph import WorkLists  # noqa: E402
from decode_work_probe import decode_streak, graph_rows  # noqa: E402


def main() -> None:
    for n in (24, 51, 256):
        size, keys = graph_rows(n)
        lists = WorkLists(8, 132, size, torch.device("cpu"))
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            decode_streak(lists, keys, size)
            runs.append((time.perf_counter() - t0) / 128 * 1e6)
        print(f"{sys.argv[1]}  N {n:3d}  us a write, min / median of 5 streaks: {min(runs):6.1f} / {sorted(runs)[2]:6.1f}")


if __name__ == "__main__":
    main()
