"""All plugin benchmarks in one run: gated_delta_scan (KDA) and short_conv, sparse MLA / DSA indexer,
MXFP4 MoE. Each part measures its baselines in the same run and reports ratios.

    python benchmarks/plugins.py [--quick] [--json PATH]

Headline figures: `kda_speedup_vs_transformers` (goal >= 3), `sparse_speedup_64k` (goal >= 8),
`sparse_time_ratio_64k_over_8k` (goal <= 1.5), `moe_speedup_vs_dequant_matmul`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plugins_attention_moe  # noqa: E402
import plugins_scan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as one flat JSON object")
    args = parser.parse_args()
    figures = {**plugins_scan.run(quick=args.quick), **plugins_attention_moe.run(quick=args.quick)}
    for key, value in figures.items():
        print(f"{key:44s} {value:.4g}" if isinstance(value, float) else f"{key:44s} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
