"""Convert the embedded GGUF into an HF model directory (fp32 safetensors, tokenizer, template).

Peers such as vLLM's CPU build load HF directories; transformers dequantises the GGUF.
Inputs come from the environment: HR_GGUF (the file) and HR_OUT (the directory to write).
"""

import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf = Path(os.environ["HR_GGUF"])
    out = Path(os.environ["HR_OUT"])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantised and refuses to save it, though its
    # weights are already dequantised: copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    # Written aside and renamed: two set-up scripts may convert at once, and a reader must
    # never see a half-written directory.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another converter finished first: keep its copy
        shutil.rmtree(tmp)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # Observed here: after the files were written, the interpreter spun at exit for minutes
    # (state R, three threads). Everything is on disk, so leave without the teardown.
    os._exit(0)
