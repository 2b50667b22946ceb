"""Fit the simulator's step-cost model to this machine and model.

    python benchmarks/calibrate_cost_model.py [--model PATH] [--threads N]
    headrace simulate --cost <printed value> --policy slo --trace ...

Runs a mixed workload (varied prompt lengths, so steps mix prefill chunks and decodes)
through the real Engine, records every step's shape and wall time, and fits
time = base + a * prefill + b * decode + c * context by least squares (the same online
model the slo policy uses). Prints the fit, its error on the steps, and the --cost value.
"""

from __future__ import annotations

import argparse
import random

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from scheduling import SamplingParams
from scheduling.cost_model import OnlineCostModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    engine = Engine(
        EngineConfig(
            model=args.model, threads=args.threads, max_num_batched_tokens=512, max_num_seqs=32
        )
    )
    rng = random.Random(0)
    steps = []
    real_process = engine.process

    def recording_process(so, ro):
        if not so.is_empty:
            steps.append((so.shape, ro.duration_s))
        return real_process(so, ro)

    engine.process = recording_process  # type: ignore[method-assign]
    # Varied prompt and output lengths, arriving in waves: steps then differ in prefill
    # tokens, decode count and context independently, which the fit needs to tell them apart.
    for wave in range(4):
        for _ in range(args.requests // 4):
            prompt = [rng.randrange(100, 40_000) for _ in range(rng.choice([16, 64, 256, 700]))]
            params = SamplingParams(
                max_tokens=rng.randrange(4, 24 + 24 * wave), temperature=0, ignore_eos=True
            )
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    fit = OnlineCostModel(forget=1.0)
    for shape, duration in steps[2:]:  # the first steps include one-time warm-up
        fit.observe(shape, duration)
    errors = [abs(fit.predict(s) - d) / d for s, d in steps[2:]]
    m = fit.model
    cost = ",".join(f"{c:.6g}" for c in m.coefficients)
    print(
        f"{len(steps)} steps; fit: base {m.base_s * 1000:.2f} ms + "
        f"{m.per_prefill_token_s * 1e6:.1f} us/prefill token + "
        f"{m.per_decode_token_s * 1e6:.1f} us/decode token + "
        f"{m.per_context_token_s * 1e9:.1f} ns/context token"
    )
    print(f"median relative error {sorted(errors)[len(errors) // 2]:.1%}")
    print(f"headrace simulate --cost {cost} ...")
    print(
        f"RESULT median_rel_error={sorted(errors)[len(errors) // 2]:.3f} steps={len(steps)} "
        f"cost={cost}"
    )


if __name__ == "__main__":
    main()
