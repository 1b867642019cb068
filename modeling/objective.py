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
        nsa_score_loss_target: "scores" (the blocks' best-key softmax), "selection" (uniform over the n - 3
        blocks that softmax would select) or "boundary" (a ranking loss: those blocks above the others);
        nsa_score_loss_temperature tau: the "scores" target's softmax of the best-key logits divided by tau (above
        1: a smoother target, which finite scores can match more closely).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from modeling.config import check_fields

SCORE_LOSS_TARGETS = ("scores", "selection", "boundary")  # nsa_score_loss_target's values
SCORE_LOSS_OPTIONS = ("nsa_score_loss_stride", "nsa_score_loss_top", "nsa_score_loss_random", "nsa_score_loss_target",
                      "nsa_score_loss_temperature")


@dataclass(frozen=True)
class Objective:
    """The training objective's terms beyond cross-entropy (the module docstring describes each field)."""

    z_loss_coef: float = 0.0
    nsa_score_loss_coef: float = 0.0
    nsa_score_loss_stride: int = 1
    nsa_score_loss_top: int = 0
    nsa_score_loss_random: int = 0
    nsa_score_loss_target: Literal["scores", "selection", "boundary"] = "scores"
    nsa_score_loss_temperature: float = 1.0

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
        tau = self.nsa_score_loss_temperature
        if not (isinstance(tau, int | float) and not isinstance(tau, bool) and 0 < tau < math.inf):
            raise ValueError(f"nsa_score_loss_temperature must be a finite number > 0, got {tau!r}")
        if tau != 1 and self.nsa_score_loss_target != "scores":
            raise ValueError(f"nsa_score_loss_temperature shapes the 'scores' target; the "
                             f"'{self.nsa_score_loss_target}' target takes only the ranking of the best-key scores: "
                             "leave the temperature at 1")
        if self.nsa_score_loss_target not in SCORE_LOSS_TARGETS:
            raise ValueError(f"nsa_score_loss_target must be 'scores', 'selection' or 'boundary', got "
                             f"{self.nsa_score_loss_target!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Objective:
        check_fields(cls, values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(Objective))
