"""The multi-draft selection study (Khisti et al. 2024) on a real target/draft pair: :mod:`.study` runs it
(``python -m bench.multidraft``), :mod:`.experiments` measures block efficiency and token-level acceptance,
:mod:`.plots` draws its figure."""
