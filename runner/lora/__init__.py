"""Multi-LoRA serving: adapters over one base model, mixed in one batch.

```
adapter.py      LoRAAdapter / LoRABase, shape and rank checks, load_adapter (format dispatch)
peft_format.py  PEFT directories (adapter_config.json + adapter_model.safetensors)
gguf_format.py  llama.cpp GGUF LoRA files (Q/K permutation of B undone)
registry.py     name -> adapter, what the daemon serves (loop thread)
layers.py       LoRALinear: the one hook, wrapped around each adaptable Linear
batch.py        LoRABatch: the step's segments (rows per adapter), built once per step
ops.py          the segmented delta on torch; runner/triton_ops/lora.py on CUDA
manager.py      LoRAManager: resident slots (--max-loras, LRU) and the per-step segments
```
"""

from runner.lora.adapter import LoRAAdapter, LoRABase, LoRAError, load_adapter
from runner.lora.manager import LoRAManager
from runner.lora.registry import LoRARegistry, UnknownAdapterError

__all__ = [
    "LoRAAdapter",
    "LoRABase",
    "LoRAError",
    "LoRAManager",
    "LoRARegistry",
    "UnknownAdapterError",
    "load_adapter",
]
