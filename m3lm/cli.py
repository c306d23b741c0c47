"""The `m3lm` command line: list (more subcommands arrive with the engine)."""

from __future__ import annotations

import argparse
import sys

from m3lm.errors import M3lmError

FAMILIES = [
    {
        "model_type": "minimax_m3_vl / minimax_m3 / minimax_m3_vl_text",
        "architecture": "MiniMaxM3SparseForConditionalGeneration (text decoder)",
        "msa": "yes (lightning indexer, per-KV-group top-k blocks)",
        "moe": "yes (sigmoid router + bias, shared expert)",
        "quantized": "mxfp8 (dequantised at load)",
    },
]


def cmd_list(_: argparse.Namespace) -> int:
    cols = ["model_type", "architecture", "msa", "moe", "quantized"]
    heads = {
        "model_type": "MODEL_TYPE",
        "architecture": "ARCHITECTURE",
        "msa": "MSA",
        "moe": "MOE",
        "quantized": "QUANTIZED",
    }
    widths = {c: max(len(heads[c]), *(len(f[c]) for f in FAMILIES)) for c in cols}
    print("  ".join(heads[c].ljust(widths[c]) for c in cols).rstrip())
    for f in FAMILIES:
        print("  ".join(f[c].ljust(widths[c]) for c in cols).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3lm", description="Run MiniMax-M3 models.")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the supported model families").set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (M3lmError, OSError, ValueError) as e:
        if args.verbose:
            raise
        print(f"m3lm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
