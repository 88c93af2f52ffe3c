"""Running test code under Triton's CPU interpreter, in a child process.

`TRITON_INTERPRET` must be set before triton is first imported, and the test
session has imported it already, so interpreter checks run in a fresh Python
with the repository root on its path.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: int, fp_fusion: bool = False) -> str:
    """Run `code` (run from the repository root) under the interpreter; assert
    it exits 0 and return its stdout."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    if fp_fusion:
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
