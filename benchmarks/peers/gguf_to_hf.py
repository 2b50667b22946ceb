"""Convert the embedded GGUF into an HF model directory (fp32 safetensors, tokenizer, template).

Peers such as vLLM's CPU build load HF directories; transformers dequantises the GGUF.
Inputs come from the environment: HR_GGUF (the file) and HR_OUT (the directory to write).
"""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf = Path(os.environ["HR_GGUF"])
    out = Path(os.environ["HR_OUT"])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
