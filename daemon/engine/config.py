"""Every knob of the engine, with defaults a user can reason about.

Each field's `help` is what `headrace serve --help` prints: one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner import threads as runner_threads


def opt(default: object, help: str) -> object:
    return field(default=default, metadata={"help": help})


@dataclass(slots=True)
class EngineConfig:
    """What model to run, where, and under which budgets."""

    model: str | None = opt(
        None, "GGUF file or HF directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (CUDA when available)")
    dtype: str = opt(
        "auto",
        "float32, bfloat16, float16, or auto (bfloat16 on CUDA and on CPUs with native bf16 "
        "matmuls, AMX or AVX512-BF16; float32 elsewhere, where bf16 is emulated and slow)",
    )
    quantization: str = opt(
        "auto",
        "linear weights: none, int8 (per-channel int8 weights, per-token int8 activations), "
        "or auto (int8 on CPU when the checkpoint is already quantised, e.g. a Q4 GGUF, and "
        "int8 beats the float path in a start-up micro-benchmark; none on CUDA)",
    )
    block_size: int = opt(16, "tokens per KV cache block")
    kv_cache_memory: int | None = opt(
        None,
        "bytes of KV cache (default: a quarter of available RAM, at most 1 GiB, on CPU; "
        "gpu-memory-utilization of free device memory on CUDA)",
    )
    kv_cache_dtype: str = opt(
        "auto",
        "how KV cache rows are stored: model (the model's dtype), int8 (each token's row per "
        "KV head as int8 values and one fp32 scale: about half of bf16's bytes, so decode "
        "attention reads half and the cache holds ~1.9x the tokens), or auto (int8 on the CPU "
        "kernels for a quantised "
        "checkpoint under quantization auto, where the weights already cost more than the "
        "rows' cost of under 0.2 percent in perplexity; model elsewhere)",
    )
    attention_backend: str = opt(
        "auto",
        "torch, cpu, triton, or auto (Triton kernels on CUDA, the C++ kernels on the CPU when "
        "they build, the torch reference otherwise)",
    )
    enforce_eager: bool = opt(
        False, "no CUDA graphs for decode-only steps (graphs need CUDA and the Triton backend)"
    )
    gpu_memory_utilization: float = opt(0.9, "fraction of free CUDA memory for the KV cache")
    max_model_len: int | None = opt(
        None, "longest prompt + output in tokens (default: the model's, capped at 8192)"
    )
    max_num_batched_tokens: int = opt(2048, "token budget of one step (prefill + decode)")
    max_num_seqs: int = opt(64, "most requests in one step")
    long_prefill_token_threshold: int = opt(
        0, "most tokens one prompt takes in one step (0: the whole budget)"
    )
    max_waiting: int = opt(256, "waiting requests beyond this are refused with 429 (0: no limit)")
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    prefix_cache_hash: str = opt(
        "sha256", "block hash: sha256 or builtin (faster, not safe across tenants)"
    )
    policy: str = opt(
        "fcfs", "scheduling policy (entry point in headrace.policies): fcfs, priority, slo, fair"
    )
    tenant_weights: str | None = opt(
        None, "fair: each tenant's share, TENANT=WEIGHT,... (e.g. a=2,b=1; others weigh 1)"
    )
    urgent_wait: float | None = opt(
        None,
        "priority: while urgent requests are about, a step of less urgent work costs at most "
        "this x a predicted urgent prefill (default 0.3; 0 turns the cap off)",
    )
    speculative_method: str = opt(
        "none",
        "speculative decoding proposer: none, ngram (prompt lookup), or a plugin name in "
        "headrace.proposers; turns the batch-queue overlap off",
    )
    num_speculative_tokens: int = opt(3, "most draft tokens per request per step (k)")
    prompt_lookup_min: int = opt(2, "ngram: shortest context suffix to look up")
    prompt_lookup_max: int = opt(5, "ngram: longest context suffix to look up")
    speculative_adaptive: bool = opt(
        True,
        "give a request fewer drafts while its drafts keep being rejected (verifying costs "
        "forward rows; on CPU that is not free)",
    )
    lora_modules: tuple[str, ...] = opt(
        (),
        "LoRA adapters to serve over the model, each name=path (a PEFT directory with "
        "adapter_config.json + adapter_model.safetensors, or a llama.cpp GGUF LoRA file); a "
        "request names one by `model`",
    )
    max_loras: int = opt(4, "LoRA adapters resident at once (running requests use at most these)")
    max_lora_rank: int = opt(16, "highest LoRA rank an adapter may have")
    enable_lora_runtime_updates: bool = opt(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key)"
    )
    kv_connector: str = opt(
        "none",
        "a second source of prompt KV (entry point in headrace.kv_connectors): disk (a "
        "persistent prefix-cache tier under the cache directory) or peer (prefill/decode "
        "disaggregation; with --kv-role and --kv-peer); none for neither",
    )
    kv_role: str | None = opt(
        None, "peer connector: producer (computes prompts, serves their KV) or consumer"
    )
    kv_peer: str | None = opt(
        None,
        "peer connector: the producer's KV address, a Unix socket path or host:port (a "
        "producer listens there, a consumer pulls from there; a consumer that only pulls "
        "from the producers its requests name, as in --prefill-replicas, may leave it unset)",
    )
    kv_peer_shm: bool = opt(
        True,
        "peer connector on a Unix socket: move blocks through shared memory (a sealed memfd "
        "whose fd goes over the socket) instead of the socket stream; either side may turn "
        "it off and the other follows (TCP always streams)",
    )
    kv_store_gb: float = opt(
        4.0, "bound on the KV connector's store: the disk tier's files, a producer's RAM"
    )
    kv_disk_dir: str | None = opt(
        None, "disk connector: folder of the persistent KV tier (default: <cache dir>/kv)"
    )
    kv_commit_mb_per_step: float = opt(
        16.0,
        "KV connector: most MiB of loaded KV one step copies into the paged cache while other "
        "requests run, so a long prompt's load spreads over steps instead of stretching one "
        "of their decode steps (all of it when nothing else runs)",
    )
    deterministic: bool = opt(
        False,
        "batch-invariant greedy: a request's output does not depend on its batch-mates (one "
        "linear path for every batch size: no small-batch int8 copies, calls padded to the "
        "row count from which the matmul kernels agree; fixed thread count). Off: outputs "
        "may change with batch composition (see README)",
    )
    grammar_cache_mb: float = opt(
        256.0,
        "MiB of compiled grammars kept for reuse, counted by xgrammar's own memory figure "
        "(least recently used go first; a larger grammar is served but not kept)",
    )
    grammar_max_bytes: int = opt(
        64 << 10,
        "largest output constraint per request in bytes (the schema as compact JSON, the "
        "regex, the grammar, all choices together); larger answers 400 (0: no limit)",
    )
    grammar_max_choices: int = opt(1024, "most strings in one guided_choice (0: no limit)")
    grammar_compile_timeout: float = opt(
        30.0,
        "seconds one grammar compile may take once a worker starts it (time queued is not "
        "counted); past it the compile is stopped and its requests answer 400",
    )
    grammar_workers: int = opt(
        2,
        "grammar compile worker processes; compiles queue per client and one client never "
        "holds all of them",
    )
    tensor_parallel_size: int = opt(
        1,
        "ranks the model is split across (tensor parallelism): N-1 worker processes plus "
        "the engine's own, over torch.distributed (gloo on the CPU, NCCL on CUDA); each "
        "rank is pinned to its share of the cores (1: one process, unchanged)",
    )
    tensor_parallel_timeout: float = opt(
        30.0,
        "seconds a tensor-parallel collective or step hand-off may wait for a rank; past "
        "it (or at once when a worker exits) in-flight requests fail and the daemon exits 1",
    )
    threads: int | None = opt(
        None,
        "most torch intra-op threads (default: every core this process may use; under "
        "tensor parallelism, per rank, default its share of the cores)",
    )
    thread_governor: bool = opt(
        True,
        "CPU: run a step on one thread while another process holds a core (measured per "
        "window of steps), so libgomp's spinning team never waits on a descheduled worker; "
        "off when OMP_WAIT_POLICY=PASSIVE",
    )


def default_threads() -> int:
    return runner_threads.default_threads()
