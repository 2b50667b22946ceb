"""Strict priority classes, FCFS within a class, and short steps while urgent work is about."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.cost_model import OnlineCostModel, StepCostModel
from scheduling.output import StepStats
from scheduling.policies.step_times import StepTimes
from scheduling.policy import BasePolicy
from scheduling.request import Request, RequestStatus


class PriorityPolicy(BasePolicy):
    """Rank by (priority, arrival); lower priority values are more urgent.

    Because the scheduler lets a waiting request preempt a lower-ranked running one, an
    urgent request gets in under load instead of only moving up the queue. The step that
    admits it carries nothing of lower priority (`urgent_prefill_alone`).

    What is left of an urgent request's wait is the step already in flight when it
    arrives. Where the engine can stop that step between layers and take it back (a CPU
    engine without the batch queue), it does so for urgent arrivals (`interrupts`;
    scheduling/step_undo.py). And while requests of the most urgent class seen in the last
    `window_s` share the engine with less urgent ones, each step's work for the less
    urgent ones is capped (`step_token_cap`) so that a step costs at most `urgent_wait` x
    the time of a typical urgent prefill, but never below twice the step's fixed cost;
    both priced with measured step times (step_times.py; the cost model only until steps
    have been seen). The cap and the urgent class are fixed once a step, in `begin_step`.
    The cap bounds the wait where steps cannot stop, and where they can it still keeps
    the urgent prompt's own step quick: what a long step before it sent out (its SSE
    writes, the clients' reads) would run beside it. On a CPU, where step time grows with
    the rows, this trades background throughput for the urgent TTFT (live on 2 cores,
    with steps stopping: urgent TTFT p50 ~1.0x idle with the cap, ~1.3-1.9x without, for
    ~1/3 fewer batch tokens); where a step's cost is flat in its rows (a GPU's decode) the
    cap is large and costs little. `urgent_wait=0` turns it off.
    """

    name = "priority"
    # Live, an urgent prompt admitted into a step that also ran the whole batch's decodes
    # and other prompts' chunks took ~1.9x its idle TTFT; alone in its step it takes ~1x
    # plus the wait for the step in flight.
    urgent_prefill_alone = True

    def __init__(
        self,
        urgent_wait: float = 0.3,
        window_s: float = 10.0,
        min_background_tokens: int = 4,
        prior: StepCostModel | None = None,
    ) -> None:
        if urgent_wait < 0:
            raise ValueError(f"urgent_wait: must be >= 0, got {urgent_wait}")
        self.urgent_wait = urgent_wait
        self.window_s = window_s
        # Less urgent work always gets this many tokens a step: it slows, never starves.
        self.min_background_tokens = min_background_tokens
        # The prior (and fit) only price the cap until steps have been measured.
        self.cost = OnlineCostModel(prior)
        self.times = StepTimes()
        # priority value -> when a request of it was last ranked.
        self._last_seen: dict[int, float] = {}
        # priority value -> running mean of its prompt lengths (what an arrival prefills).
        self._prompt_tokens: dict[int, float] = {}
        # Fixed by `begin_step` for the step being built: the urgent class (None: one class
        # about, or the cap is off) and the cap on the less urgent ones' tokens.
        self._urgent: int | None = None
        self.step_cap: int | None = None

    def begin_step(self, now: float, requests: Sequence[Request]) -> None:
        """Called by the scheduler once per step, before it ranks `requests` (the running
        and admissible waiting ones): notes which classes are about and what an arrival
        prefills, then fixes this step's urgent class and cap, so `rank` and
        `step_token_cap` only read them."""
        for req in requests:
            self._last_seen[req.priority] = now
            if not req.num_computed_tokens:  # not started: counted a step or two, not a run
                mean = self._prompt_tokens.get(req.priority, float(req.num_prompt_tokens))
                self._prompt_tokens[req.priority] = mean + 0.1 * (req.num_prompt_tokens - mean)
        self._urgent = self.urgent_class(now) if self.urgent_wait else None
        self.step_cap = None if self._urgent is None else self._token_cap(self._urgent)

    def rank(self, req: Request, now: float) -> tuple[int, int, int, float, str]:
        urgent = self._urgent
        if urgent is None or req.priority <= urgent:
            return (req.priority, 0, 0, req.arrival_time, req.request_id)
        # Capped: a step holds only some of this class, so its running requests take turns
        # (least output first) and rank ahead of its waiting ones, which would otherwise
        # evict them to restore arrival order.
        if req.status == RequestStatus.RUNNING:
            return (req.priority, 0, req.num_output_tokens, req.arrival_time, req.request_id)
        return (req.priority, 1, 0, req.arrival_time, req.request_id)

    def observe(self, stats: StepStats) -> None:
        self.cost.observe(stats.shape, stats.duration_s)
        self.times.observe(stats, self._urgent)

    def interrupts(self, req: Request, step: Sequence[Request]) -> bool:
        """Stop the running step for `req` when it holds less urgent work and nothing more
        urgent than `req` nor any prompt of its own class (which ranks ahead of it and
        would only be computed again). Decodes of its class may ride: they lose what the
        step had done of them, about half a capped step, once; on a CPU engine `req` then
        starts at once instead of after the rest of the step."""
        lower = False
        for r in step:
            if r.priority < req.priority or (r.priority == req.priority and not r.output_token_ids):
                return False
            lower |= r.priority > req.priority
        return lower

    def urgent_class(self, now: float) -> int | None:
        """The most urgent priority seen lately, when a less urgent one was seen too."""
        recent = [p for p, t in self._last_seen.items() if now - t <= self.window_s]
        if len(recent) < 2:
            return None
        return min(recent)

    def step_token_cap(self, req: Request, now: float) -> int | None:
        """Most tokens a step may hold when `req` is added (None: no cap beyond the budget).

        Urgent requests are never capped; the scheduler guarantees the less urgent ones
        `min_background_tokens` a step whatever the cap says.
        """
        if self._urgent is None or req.priority <= self._urgent:
            return None
        return self.step_cap

    def _token_cap(self, urgent: int) -> int | None:
        """Tokens of less urgent work per step such that a step costs about `urgent_wait` x
        a typical urgent prompt's step, but at least twice a step's fixed cost (below that
        a step is mostly fixed cost: capping costs more throughput than it saves wait).

        Priced with measured step times (step_times.py) once there are any, with the cost
        model before that. None: the model sees no cost in tokens, so capping buys nothing.
        """
        model = self.cost.model
        prompt = max(1, round(self._prompt_tokens.get(urgent, 1.0)))
        urgent_s = self.times.prompt_time(urgent, prompt) or model.prefill_time(prompt)
        token_s = self.times.token_s
        if token_s is None:
            # Priced at the dearer of a prompt or a decode token: the cap holds for either.
            per_token = max(model.per_prefill_token_s, model.per_decode_token_s)
            if per_token < 1e-9:
                return None
            step_s = max(self.urgent_wait * urgent_s, 2 * model.base_s)
            return max(self.min_background_tokens, int((step_s - model.base_s) / per_token))
        # A one-token step's time stands for the fixed cost.
        fixed_s = self.times.single_step_s or model.base_s
        step_s = max(self.urgent_wait * urgent_s, 2 * fixed_s)
        # `token_s` is the steps' own time per token, fixed cost included: a step of n
        # tokens that took d makes the cap n * step_s / d, so the cap settles where a
        # capped step takes step_s, whatever its rows cost (context, threads, neighbours).
        # Rounded, not truncated: a cap one token short of its fixed point would stay there.
        return max(self.min_background_tokens, round(step_s / token_s))
