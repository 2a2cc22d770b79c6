"""REPORT.md from the committed results under ``bench/results/``: ``python -m bench.report``.

:mod:`.build` loads the results and assembles the report; :mod:`.summary` (with :mod:`.summary_data`,
:mod:`.summary_kernels`, :mod:`.glance`) renders the one-screen summary, :mod:`.tables` the paper-layout tables
beside the paper's numbers (:mod:`.paper`), :mod:`.quality` the bootstrap quality table, :mod:`.e2e` the end-to-end
tables and :mod:`.multidraft` the multi-draft section. Method names and columns come from the verify method registry.
"""
