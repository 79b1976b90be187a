"""Diagnostics of "global context collapse": rank and entropy of implied attention matrices.

Softmax, plain linear attention and MHLA compared on the q, k a diffusers transformer computes on
real inputs (MHLA paper, arXiv 2601.07832, Sec. 3.2, 4.3, Fig. 3): :mod:`.attention` (matrices,
rank, entropy, bounds), :mod:`.capture` (q, k of a real forward), :mod:`.pipeline` (a DiT pipeline
end to end, what ``benchmarks/diagnose.py`` runs), :mod:`.plots` (PNG pictures). Dense O(N^2) per
head, at most :data:`MAX_TOKENS` tokens. See ``docs/diagnostics.md``.
"""

from mhla_diffusers.diagnostics.attention import KINDS, MAX_TOKENS, attention_matrix, default_rtol, matrix_rank, rank_bound, row_entropy
from mhla_diffusers.diagnostics.capture import QueryKey, capture_query_key, layer_statistics, qk_statistics
from mhla_diffusers.diagnostics.pipeline import diagnose_pipeline, diagnostic_inputs, markdown_report, write_report
from mhla_diffusers.diagnostics.plots import plot_mixing_matrix, plot_rank_entropy

__all__ = [
    "KINDS",
    "MAX_TOKENS",
    "attention_matrix",
    "matrix_rank",
    "default_rtol",
    "row_entropy",
    "rank_bound",
    "QueryKey",
    "capture_query_key",
    "qk_statistics",
    "layer_statistics",
    "diagnostic_inputs",
    "diagnose_pipeline",
    "write_report",
    "markdown_report",
    "plot_mixing_matrix",
    "plot_rank_entropy",
]
