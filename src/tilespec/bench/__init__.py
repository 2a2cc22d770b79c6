"""Measure and report: the library's benchmarks over the public API, one module per measurement.

* :mod:`.verify` (``tilespec bench verify``): the verification step alone, every registered method against
  transformers and FlashInfer, on one GPU;
* :mod:`.e2e` (``tilespec bench e2e``): whole decoding loops, transformers' systems against the engine with any
  draft the engine's drafter names resolve (:mod:`.e2e_systems`);
* :mod:`.quality` (``tilespec eval``): quality (ROUGE / WER) beside speed per method on the same examples and seeds
  (:mod:`.harness`, :mod:`.warmup`, :mod:`.chunks`, :mod:`.aggregate`, :mod:`.config`, :mod:`.tasks`,
  :mod:`.metrics`, datasets in :mod:`.data`).

Each writes one JSON record with the device, versions, commit and raw numbers. Report generation, the paper's side
studies, paper-scale runs and data makers are the repository's own (its top-level ``bench`` package); nothing
in the library imports them. Arrows point one way: bench -> engine -> verify.
"""
