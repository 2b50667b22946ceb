"""Step-time models: a fixed one for the simulator, an online-fitted one for the SLO policy.

step time = base + a * prefill tokens + b * decode tokens + c * context tokens
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.output import StepShape


def _features(shape: StepShape) -> tuple[float, float, float, float]:
    return (
        1.0,
        float(shape.num_prefill_tokens),
        float(shape.num_decode_tokens),
        float(shape.num_context_tokens),
    )


@dataclass(slots=True)
class StepCostModel:
    """Linear step-time model, in seconds. Defaults: a small model on one modern GPU."""

    base_s: float = 0.006
    per_prefill_token_s: float = 40e-6
    per_decode_token_s: float = 80e-6
    per_context_token_s: float = 0.02e-6

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (
            self.base_s,
            self.per_prefill_token_s,
            self.per_decode_token_s,
            self.per_context_token_s,
        )

    def predict(self, shape: StepShape) -> float:
        return max(0.0, sum(w * x for w, x in zip(self.coefficients, _features(shape))))

    def prefill_time(self, num_tokens: int) -> float:
        """Time of a step that prefills `num_tokens` and nothing else."""
        return self.predict(StepShape(num_prefill_tokens=num_tokens, num_context_tokens=num_tokens))


class OnlineCostModel:
    """Least-squares fit of StepCostModel from observed steps, with exponential forgetting.

    NOTE: a ridge term pulls each coefficient toward the prior, so a direction the
    workload has not exercised yet (say, no prefill seen) keeps its prior value instead of
    an arbitrary one.
    """

    def __init__(
        self, prior: StepCostModel | None = None, forget: float = 0.995, ridge: float = 1e-3
    ) -> None:
        self.prior = prior or StepCostModel()
        self.model = StepCostModel(*self.prior.coefficients)
        self.forget = forget
        self.ridge = ridge
        self.num_observations = 0
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4

    def observe(self, shape: StepShape, duration_s: float) -> None:
        x = _features(shape)
        for i in range(4):
            self._xty[i] = self.forget * self._xty[i] + x[i] * duration_s
            for j in range(4):
                self._xtx[i][j] = self.forget * self._xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        prior = self.prior.coefficients
        a = [row[:] for row in self._xtx]
        b = self._xty[:]
        for i in range(4):
            a[i][i] += self.ridge
            b[i] += self.ridge * prior[i]
        coef = _solve(a, b)
        if coef is not None:
            self.model = StepCostModel(*(max(0.0, c) for c in coef))

    def predict(self, shape: StepShape) -> float:
        return self.model.predict(shape)

    def prefill_time(self, num_tokens: int) -> float:
        return self.model.prefill_time(num_tokens)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x
