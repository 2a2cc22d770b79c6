"""The repository's own benchmarks, studies and report generator (not installed with tilespec).

Run from the root of a checkout, over the installed library: ``python -m benchmarks.report`` (REPORT.md),
``python -m benchmarks.studies`` (the seed paper's side studies on top of ``tilespec eval``), ``python -m
benchmarks.scale`` (the paper-scale evaluation in time-budgeted stages), ``python -m benchmarks.synth`` (the synthetic
espeak-ng ASR set), ``python -m benchmarks.multidraft`` (the multi-draft selection study) and ``python -m
benchmarks.repeatability``. Arrows point one way: benchmarks -> tilespec (bench, engine, verify); nothing in
``src/tilespec`` imports this package.
"""
