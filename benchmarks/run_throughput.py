"""Serving benchmark of ``llmplug.Engine`` in one device-machine call (same as ``llmplug bench throughput``).

Usage: python benchmarks/run_throughput.py --model llama-8b --workloads a b c d e --rates 2 4 8 16 [--stock-requests N]
       [--scale 0.05] [--out benchmarks/results/FILE.json] [--commit SHA]
       python benchmarks/run_throughput.py --from-json benchmarks/results/FILE.json   # table and plot again
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmplug.bench import throughput  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(ap, default_out="benchmarks/results")
    return throughput.main(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
