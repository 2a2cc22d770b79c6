"""``tilespec bench verify|e2e``: benchmarks, each implemented by ``tilespec.bench.<name>``.

Each benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int`` and keeps heavy imports inside
``run`` so that building the CLI stays fast. The multi-draft selection study is the repository's
``python -m bench.multidraft``.
"""
from __future__ import annotations

import importlib

BENCHMARKS = {
    "verify": "verification step: every method vs transformers and FlashInfer (GPU)",
    "e2e": "end-to-end speculative decoding on real models vs HF assisted generation",
}


def register(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark and write JSON under bench/results/")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"tilespec.bench.{name}")
        parser = bench_sub.add_parser(name, help=help_text)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
