"""What training minimises besides next-token cross-entropy: `Objective`, set by the training side (train.py's
options of the same names) on a model as `model.objective`. It changes no weight's meaning and nothing at inference;
a model built without one trains on the plain cross-entropy.

    z_loss_coef: weight of the z-loss, logsumexp(logits)^2 per predicted token (PaLM), which keeps the output
        layer's normaliser near 1.
    nsa_score_loss_coef: weight of each NSA layer's selection-scoring loss (nsa/scoring.py), which teaches the
        importance scores which blocks to select; and how it is computed:
        nsa_score_loss_stride k: every k-th query (from a random offset), at 1/k of the cost;
        nsa_score_loss_top m > 0: the target and prediction over each query's m blocks of highest importance only,
        and nsa_score_loss_random r random other blocks (0: every block, reading every key);
        nsa_score_loss_target: "scores" (the blocks' best-key softmax) or "selection" (uniform over the n - 3
        blocks that softmax would select).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from modeling.config import ModelConfig, check_fields

SCORE_LOSS_OPTIONS = ("nsa_score_loss_stride", "nsa_score_loss_top", "nsa_score_loss_random", "nsa_score_loss_target")


@dataclass(frozen=True)
class Objective:
    """The training objective's terms beyond cross-entropy (the module docstring describes each field)."""

    z_loss_coef: float = 0.0
    nsa_score_loss_coef: float = 0.0
    nsa_score_loss_stride: int = 1
    nsa_score_loss_top: int = 0
    nsa_score_loss_random: int = 0
    nsa_score_loss_target: Literal["scores", "selection"] = "scores"

    def __post_init__(self) -> None:
        for name in ("z_loss_coef", "nsa_score_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name, low in (("nsa_score_loss_stride", 1), ("nsa_score_loss_top", 0), ("nsa_score_loss_random", 0)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.nsa_score_loss_random and not self.nsa_score_loss_top:
            raise ValueError("nsa_score_loss_random goes with nsa_score_loss_top > 0 (the dense target already reads "
                             "every block): set nsa_score_loss_top too")
        if self.nsa_score_loss_target not in ("scores", "selection"):
            raise ValueError(f"nsa_score_loss_target must be 'scores' or 'selection', got "
                             f"{self.nsa_score_loss_target!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Objective:
        check_fields(cls, values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(Objective))


def score_loss_queries(model: ModelConfig) -> int:
    """Queries of a context_length sequence at which NSA's top-n really chooses, and so the selection-scoring loss
    has a target (`nsa.blocks.contested_blocks`): those from n x l' on, none when n < 4."""
    first = model.nsa_num_selected * model.nsa_select_block_size
    return max(0, model.context_length - first) if model.nsa_num_selected >= 4 else 0


def check_objective(model: ModelConfig, objective: Objective, given: set[str] | frozenset[str]) -> None:
    """ValueError, naming the option, when a field of `objective` that was given (`given`) cannot act with `model`:
    the selection-scoring loss without NSA, its options without its weight, a loss that would be 0 on every step
    (top-n never chooses at this context_length) or on most (a stride beyond the queries that choose)."""
    given = set(given) & set(FIELDS)
    if "nsa_score_loss_coef" in given and model.attention_type != "nsa":
        raise ValueError(f"--nsa_score_loss_coef has no effect without attention_type 'nsa', and this run's is "
                         f"{model.attention_type!r}: leave it out, or pass --attention_type nsa")
    if given & set(SCORE_LOSS_OPTIONS) and objective.nsa_score_loss_coef == 0:
        name = sorted(given & set(SCORE_LOSS_OPTIONS))[0]
        raise ValueError(f"--{name} has no effect without --nsa_score_loss_coef > 0: add it, or leave --{name} out")
    if objective.nsa_score_loss_coef == 0:
        return
    queries, first = score_loss_queries(model), model.nsa_num_selected * model.nsa_select_block_size
    if queries == 0:
        raise ValueError(f"--nsa_score_loss_coef: top-n never chooses at context_length {model.context_length} (only "
                         f"from n x l' = {first} tokens on, with nsa_num_selected >= 4), so the loss would be 0 on "
                         f"every step: train at a context_length above {first}, or leave it out")
    if objective.nsa_score_loss_stride > queries:
        raise ValueError(f"--nsa_score_loss_stride {objective.nsa_score_loss_stride} exceeds the {queries} queries "
                         f"where top-n chooses (context_length {model.context_length} - n x l' {first}), so most "
                         f"steps would score none: pass at most {queries}")
