"""Attention-score collection for score-based eviction policies (H2O, Scissorhands, TOVA, SnapKV): fused attention
kernels do not return probabilities, so the engine computes them from the queries and the live keys itself."""

from vtoken_sglang.scoring.collector import ScoreCollector, resolve_layers
from vtoken_sglang.scoring.reference import decode_scores_headsum

__all__ = ["ScoreCollector", "decode_scores_headsum", "resolve_layers"]
