"""Numbers transcribed from the seed paper (Wagner et al. 2024, "Optimized Speculative Sampling for GPU Hardware
Accelerators"), A100 80 GB, transformers 4.38.2 baseline, fp16, batch 1, γ heuristic. Only the rows the report
sets beside ours; Δ% = relative reduction vs the baseline (positive = faster).
"""
from __future__ import annotations

# Table 1 (profiling time = total GPU time in the speculative sampling step). (dataset, target, draft):
# (metric, baseline, exact, sigmoid, Δ% exact, Δ% sigmoid)
TABLE1 = [
    ("LibriSpeech clean", "Whisper Small.EN", "Distil-Whisper Small.EN", "WER", 0.08, 0.08, 0.09, 11.7, 71.9),
    ("LibriSpeech other", "Whisper Small.EN", "Distil-Whisper Small.EN", "WER", 0.14, 0.14, 0.15, 10.7, 74.6),
    ("TED-LIUM release3", "Whisper Small.EN", "Distil-Whisper Small.EN", "WER", 0.22, 0.22, 0.24, 12.5, 78.9),
    ("CV16 en", "Whisper Small.EN", "Distil-Whisper Small.EN", "WER", 0.22, 0.22, 0.27, 10.4, 66.8),
    ("LibriSpeech clean", "Whisper Large V2", "Distil-Whisper Large V2", "WER", 0.07, 0.07, 0.15, 10.8, 83.9),
    ("LibriSpeech other", "Whisper Large V2", "Distil-Whisper Large V2", "WER", 0.12, 0.12, 0.19, 11.4, 84.0),
    ("TED-LIUM release3", "Whisper Large V2", "Distil-Whisper Large V2", "WER", 0.20, 0.20, 0.23, 11.4, 83.3),
    ("CV16 en", "Whisper Large V2", "Distil-Whisper Large V2", "WER", 0.25, 0.25, 0.31, 8.7, 78.5),
    ("CNN/DM", "Llama2 7B", "Sheared Llama 1.3B", "ROUGE-1", 0.30, 0.30, 0.26, 5.7, 78.0),
    ("CNN/DM", "Llama2 13B", "Sheared Llama 1.3B", "ROUGE-1", 0.31, 0.31, 0.29, 10.1, 37.2),
    ("CNN/DM", "Qwen 7B", "Qwen 0.5B", "ROUGE-1", 0.31, 0.31, 0.26, 6.8, 92.4),
    ("CNN/DM", "Gemma 7B", "Gemma 2B", "ROUGE-1", 0.23, 0.23, 0.17, 10.6, 68.4),
]
TABLE1_RANGES = {"exact": (5.7, 12.5), "sigmoid": (37.2, 93.6)}   # as stated in §4.2 (XSum rows included)

# Table 5: wall-clock Δ% (exact, sigmoid) for the closest model pairs
TABLE5 = [
    ("CV16 en", "Whisper Small.EN", "Distil-Whisper Small.EN", 8.1, 51.8),
    ("LibriSpeech clean", "Whisper Small.EN", "Distil-Whisper Small.EN", 5.8, 49.5),
    ("CNN/DM", "Qwen 7B", "Qwen 0.5B", 1.6, 39.8),
    ("XSum", "Qwen 7B", "Qwen 0.5B", 4.3, 59.1),
]

# Table 6: ms per decoding step in the sampling step, mean ± std: (baseline, exact, sigmoid), Δ% exact, sigmoid
TABLE6 = [
    ("LibriSpeech clean", "Whisper Small.EN", "Distil Small.EN", (4.31, 1.00), (3.81, 0.80), (3.15, 1.13), 11.7, 27.0),
    ("CV16 en", "Whisper Small.EN", "Distil Small.EN", (4.14, 0.85), (3.71, 0.70), (3.33, 1.10), 10.4, 19.8),
    ("CNN/DM", "Qwen 7B", "Qwen 0.5B", (12.01, 1.08), (11.20, 1.03), (3.34, 0.45), 6.8, 72.2),
    ("XSum", "Qwen 7B", "Qwen 0.5B", (11.55, 1.39), (10.65, 1.51), (3.20, 0.42), 7.8, 72.3),
]

# Table 8: Qwen 7B / Qwen 0.5B on 10% of XSum: acceptance rate and ms/step for initial γ = 3, 5, 10, 15
TABLE8_QWEN = {
    "sigmoid": ((46.2, 47.8, 48.1, 47.8), (2.92, 2.89, 2.84, 2.83)),
    "exact": ((46.8, 45.7, 48.4, 48.0), (3.91, 3.97, 3.88, 3.95)),
    "baseline": ((46.8, 45.7, 48.4, 48.0), (4.45, 4.49, 4.41, 4.48)),
}
TABLE8_GAMMAS = (3, 5, 10, 15)

# Tables 2/7: sigmoid scale sweep: scale -> (metric, Δ% profiling)
TABLE7 = {
    "Whisper Small.EN / Distil Small.EN (CV16, WER; baseline 0.24)":
        {10: (0.41, 24.0), 1e3: (0.28, 59.5), 1e4: (0.26, 64.6), 1e5: (29.34, -10826.1)},
    "Qwen 7B / Qwen 0.5B (XSum, ROUGE-1; baseline 0.18)":
        {10: (0.09, 57.6), 1e3: (0.12, 71.4), 1e4: (0.12, 71.5), 1e5: (0.11, 71.7)},
}

# Table 3: realized bandwidth GB/s (baseline, exact, sigmoid), Nsight Compute sectors x 32 B / kernel time
TABLE3 = [
    ("Whisper Small.EN / Distil-Whisper Small.EN", 13.98, 14.16, 16.33),
    ("Qwen 7B / Qwen 0.5B", 44.99, 31.65, 52.14),
]
