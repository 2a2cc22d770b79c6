"""The repository's own measuring tools (not installed with tilespec), run from the root of a checkout.

* ``bench/gpu/`` the GPU runbook (``run.sh`` stages, ``lanes.sh``; README.md names every script it runs);
* ``bench/scripts/`` one-off GPU measurements the runbook runs (each writes a file under ``bench/results/``);
* ``bench/results/`` the committed result files every number of README.md and REPORT.md comes from;
* ``python -m bench.report`` REPORT.md from those results;
* ``python -m bench.studies`` (the seed paper's side studies on top of ``tilespec eval``), ``python -m bench.scale``
  (the paper-scale evaluation in time-budgeted stages), ``python -m bench.multidraft`` (the multi-draft selection
  study), ``python -m bench.repeatability``;
* data makers: ``python -m bench.synth`` (the synthetic espeak-ng ASR set), ``python -m bench.make_code_edit``.

Arrows point one way: this package -> tilespec; nothing in ``src/tilespec`` imports it.
"""
