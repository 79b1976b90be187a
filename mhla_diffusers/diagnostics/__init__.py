"""Diagnostics of "global context collapse": rank and entropy of implied attention matrices.

The MHLA paper (arXiv 2601.07832, Sec. 3.2 and Fig. 3) diagnoses plain linear attention by two
numbers of its attention matrix ``A`` (``[N, N]``, one per head, rows = queries):

* **rank** — ``A_lin = phi(Q) phi(K)^T`` has ``rank(A_lin) <= min(rank(phi(Q)), rank(phi(K))) <= d``
  (Sec. 3.2, "rank collapse"); MHLA's ``A[i, t] = Mc[b(i), b(t)] phi(q_i) . phi(k_t)`` stacks
  per-query-block products ``phi(Q_b) Y_b`` and reaches
  ``rank(A_MHLA) <= min(N, sum_b min(N_b, d))`` (Sec. 4.3); softmax attention is not bounded
  below ``N``.
* **entropy** — the mean Shannon entropy of the rows of the row-normalised ``A`` (Fig. 3(a)):
  linear attention spreads each query's mass almost uniformly (high entropy), softmax and MHLA
  concentrate it (lower entropy).

This package measures both for softmax, plain (ReLU) linear attention and MHLA on the very q, k a
diffusers transformer computes on real inputs, and draws mixing matrices on their block grid:

* :func:`attention_matrix` — the three row-normalised ``[B, heads, N, N]`` matrices (float64);
* :func:`matrix_rank`, :func:`row_entropy`, :func:`rank_bound` — the numbers and the paper's bounds;
* :func:`capture_query_key`, :func:`qk_statistics`, :func:`layer_statistics` — q, k captured in a
  real forward, then rank / entropy per head for the three kinds;
* :func:`diagnostic_inputs`, :func:`diagnose_pipeline`, :func:`write_report` — what
  ``benchmarks/diagnose.py`` runs on a (converted) DiT pipeline folder;
* :func:`plot_mixing_matrix`, :func:`plot_rank_entropy` — PNG pictures (matplotlib, Agg canvas).

Everything here is dense ``O(N^2)`` per head and meant for diagnosis: at most
:data:`MAX_TOKENS` tokens (a 64 x 64 token grid).

Modules: :mod:`.attention` (the matrices, rank, entropy, bounds), :mod:`.capture` (q, k of a real
forward, statistics per layer), :mod:`.pipeline` (a DiT pipeline end to end, the report),
:mod:`.plots` (pictures).
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
