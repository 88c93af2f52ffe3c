"""`kvserve diagnose`: findings for a live server (--url) or a record (--offline)."""
from __future__ import annotations

import argparse
from typing import Any


def add_diagnose_parser(sub: Any) -> None:
    p = sub.add_parser("diagnose", help="name what is wrong with a deployment's KV cache and how to fix it")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running kvserve server, e.g. http://127.0.0.1:8000")
    src.add_argument("--offline", metavar="FILE", help="a JSON record (kvserve bench sweep --save-records, "
                                                       "kvserve.diagnose.record.MetricsRecorder)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to sample the server (--url)")
    p.add_argument("--period", type=float, default=1.0, help="seconds between samples (--url)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="stop sampling once N requests finished in the window, within --duration (--url)")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], ...} instead of text')
    p.set_defaults(func=cmd_diagnose)


def cmd_diagnose(a: argparse.Namespace) -> int:
    from kvserve.diagnose.record import load_record
    from kvserve.diagnose.report import analyze, format_json, format_text
    from kvserve.diagnose.sources import sample_server
    from kvserve.diagnose.window import Window
    record = load_record(a.offline) if a.offline else sample_server(a.url, a.duration, a.period, a.requests)
    result = analyze(Window(record.samples, record.config, record.requests))
    print(format_json(result) if a.json else format_text(result))
    return 0


def add_profile_parser(sub: Any) -> None:
    from kvserve.bench.profile import add_profile_args
    p = sub.add_parser("profile", help="a workload under torch.profiler: per-kernel time, launches per step, "
                                       "decode attention GB/s, Chrome trace")
    add_profile_args(p)
