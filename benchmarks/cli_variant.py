"""`kvserve` CLI with MIN_SPLIT=N overriding the decode kernel's min_split_keys (an A/B helper):

  MIN_SPLIT=128 python3 benchmarks/cli_variant.py bench throughput --model dummy:qwen3-8b --latency ...
"""
import sys

from step_diagnostics import patch_decode_config

patch_decode_config()
from kvserve.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
