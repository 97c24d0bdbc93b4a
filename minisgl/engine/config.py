"""The engine section of the config tree: what one rank's engine is built from.

Fields made by `setting` are user settings (CLI flags, TOML keys, `LLM` keywords; see
minisgl/settings.py). The others are per-rank runtime values, filled in by `for_rank`: every
rank's config is the same but for `tp_info.rank`.
"""

from __future__ import annotations

import json
import os

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from minisgl.devices import DTYPE_NAMES, KV_CACHE_DTYPES, dtype_name, resolve_device
from minisgl.distributed.info import DistributedInfo
from minisgl.distributed.modes import ALLREDUCE_MODES, check_allreduce_mode
from minisgl.models.checkpoint_quant import QUANTIZATIONS
from minisgl.models.pooling import parse_pooler_config
from minisgl.settings import Alias, check_choices, json_object, setting

if TYPE_CHECKING:  # imported where a torch value is asked for: the launcher reads this config
    import torch

PDL_MODES = ("auto", "on", "off")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = ""  # the resolved model directory
    tp_info: DistributedInfo = DistributedInfo(0, 1)  # this rank among `tp`
    tp: int = setting(1, "tensor-parallel size: the model is split over this many ranks, one "
                         "process and one device each",
                      also=("tensor-parallel-size", "tp-size"))
    # A rank's config holds the resolved device; checks that need the device wait until then.
    device: str = setting("auto", "auto (CUDA where present, else CPU), cpu or cuda (rank r "
                                  "uses cuda:r; over several nodes, its index among its "
                                  "node's ranks)", choices=DEVICES)
    dtype: Optional[str] = setting(None, "dtype of the weights and the KV cache: float32, "
                                         "bfloat16 or float16 (fp32, bf16, fp16); unset or "
                                         "auto: bfloat16 on CUDA, float32 on CPU (exact "
                                         "comparison with Hugging Face)", choices=DTYPE_NAMES)
    max_model_len: Optional[int] = setting(None, "context length in tokens (prompt and output), "
                                                 "at most the model's own; unset: the model's",
                                           also=("context-length",))
    kv_cache_dtype: str = setting("auto", "dtype of the KV cache: auto (the model's dtype) or "
                                          "fp8_e4m3 (fp8; FP8 e4m3 with per-layer K and V "
                                          "scales from the checkpoint, 1.0 where it gives none: "
                                          "twice the tokens in the same memory; CUDA needs "
                                          "compute capability 8.9+)", choices=KV_CACHE_DTYPES)
    page_size: int = setting(16, "tokens per KV-cache page", also=("block-size",))
    max_running_requests: int = setting(256, "the most requests in flight at once (rows of the "
                                             "page table)", also=("max-num-seqs",))
    max_kv_tokens: Optional[int] = setting(None, "KV pool capacity in tokens; unset: on CPU the "
                                                 "memory of 16384 tokens in the model's dtype, "
                                                 "on GPU the mem_fraction share of the memory "
                                                 "free after the weights")
    kv_cache_memory: Optional[int] = setting(
        None, "vLLM's --kv-cache-memory: the KV pool's size in bytes on each rank (its pages "
              "of the KV dtype that fit), whatever mem_fraction and gpu_memory_utilization "
              "say; refused where more than the free memory of the GPU or with "
              "max_kv_tokens", also=("kv-cache-memory-bytes",))
    mem_fraction: float = setting(0.85, "share of the GPU memory free after the weights that "
                                        "the KV pool takes (when max_kv_tokens is unset)")
    gpu_memory_utilization: Optional[float] = setting(
        None, "vLLM's: the share of the GPU's total memory this instance may hold in all "
              "(weights, KV pool, activations), whatever other processes hold; the KV pool "
              "then takes mem_fraction of what is left of it after the weights (and never "
              "more than mem_fraction of the free memory). Two instances on one GPU: 0.45 "
              "each. unset: no limit but the free memory")
    quantization: Optional[str] = setting(
        None, "fp8: the decoder's projections in FP8, quantized per output channel as the "
              "checkpoint loads (dynamic per-token activation scales on CUDA; on the CPU the "
              "weights are dequantized again, weight-only); a checkpoint that config.json "
              "says is FP8 (compressed-tensors, fp8) is read as it is. unset: as the "
              "checkpoint is. FP8 on CUDA needs compute capability 8.9 or newer. vLLM's "
              "names of checkpoint methods (awq, awq_marlin, gptq, gptq_marlin, "
              "compressed-tensors) state what the checkpoint is: refused at start-up unless "
              "its config.json agrees",
        choices=QUANTIZATIONS)
    hf_overrides: Optional[str] = setting(
        None, "vLLM's: a JSON object of config.json keys that replace the model's (a "
              "multimodal checkpoint's text_config's too), e.g. '{\"is_matryoshka\": true}' "
              "or a rope_scaling with its max_position_embeddings", json_value=True)
    enable_expert_parallel: bool = setting(
        False, "vLLM's: a mixture of experts' routed experts split over the tensor-parallel "
               "ranks whole, 1/tp of them each (every expert's GEMMs at full width; FP8 "
               "blocks and packed groups never cut), instead of 1/tp of every expert",
        also=("expert-parallel",))
    pooler_config: Optional[str] = setting(
        None, "vLLM's: how embeddings pool the prompt, a JSON object '{\"pooling_type\": "
              "\"MEAN\", \"normalize\": false}' (LAST, MEAN or CLS; normalize: L2, the "
              "default; dimensions: a Matryoshka model's embeddings cut to that length where "
              "a request names none); unset: the model's sentence-transformers Pooling "
              "module's, else the last token's", also=("override-pooler-config",), json_value=True)
    lora_modules: Optional[str] = setting(
        None, "LoRA adapters served beside the base model, NAME=PATH pairs separated by commas "
              "(PEFT directories: adapter_config.json, adapter_model.safetensors); a request "
              "runs with one by naming it as its model (offline: lora_request or "
              "SamplingParams.lora_name). They load at start-up on every rank; more load and "
              "unload at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter; offline: "
              "LLM.add_lora). They adapt attention and dense or shared-expert MLPs (16-bit, "
              "FP8 or packed weights), not routed experts",
        also=("lora-paths",))
    max_lora_rank: int = setting(16, "the largest rank a LoRA adapter may have (the adapters' "
                                     "buffers are sized for it)")
    max_loras: int = setting(
        0, "LoRA adapter slots: how many adapters may be loaded at once (each slot's buffers "
           "are allocated at start-up). 0: as many as lora_modules names, and at least 1 with "
           "enable_lora", also=("max-loaded-loras",))
    enable_lora: bool = setting(False, "serve LoRA adapters: with no lora_modules, the slots "
                                       "(max_loras) start empty and adapters load at run time")
    lora_dtype: str = setting("auto", "vLLM's: the adapters' dtype, auto or the model's own "
                                      "(minisgl holds them in the model's dtype; another is "
                                      "refused at start-up)", choices=DTYPE_NAMES)
    max_cpu_loras: Optional[int] = setting(
        None, "vLLM's: accepted (at least max_loras), and it changes nothing: where vLLM keeps "
              "that many adapters in CPU memory, minisgl reads an adapter's files at each "
              "load (the OS page cache keeps the recent ones)")
    fully_sharded_loras: bool = setting(
        False, "vLLM's: accepted, and it changes nothing: each rank holds its share of the "
               "adapters as it holds the weights' (layers/lora.py)")
    enable_sleep_mode: bool = setting(
        False, "vLLM's: an idle engine may hand back its device memory and take it again "
               "(/sleep, /wake_up, /is_sleeping over HTTP; LLM.sleep, wake_up, is_sleeping; "
               "SGLang's /release_memory_occupation, /resume_memory_occupation): level 1 keeps "
               "the weights in host memory, level 2 forgets them (for a reload); the KV cache "
               "is forgotten at either", also=("enable-memory-saver",))
    enable_weights_cpu_backup: bool = setting(
        False, "SGLang's: /release_memory_occupation keeps a host copy of the weights (sleep "
               "level 1); without it they are forgotten (level 2: push or reload them before "
               "serving again)")
    swap_space: Optional[float] = setting(
        None, "vLLM's (GiB): accepted, and it changes nothing, as in vLLM since 0.8: a "
              "preempted request is computed again, not swapped to CPU memory")
    load_format: str = setting("auto", "auto or safetensors (the model directory's "
                                       "safetensors) or dummy (random weights from config.json "
                                       "alone, for benchmarks of large shapes)",
                               choices=LOAD_FORMATS)
    trust_remote_code: bool = setting(
        False, "vLLM's: accepted, and it changes nothing: minisgl runs no code from a model's "
               "repository (its own model files serve the architectures it supports)")
    attention_backend: str = setting("auto", "auto (triton on CUDA, torch on CPU), torch or "
                                             "triton", choices=ATTENTION_BACKENDS)
    seed: int = setting(0, "seed of the dummy weights and of the sampling noise of requests "
                           "that give no seed of their own")
    fused_ops: bool = setting(True, "fused Triton kernels for RMSNorm, SiLU-and-mul, rotary "
                                    "embedding, the MoE experts and packed AWQ / GPTQ weights "
                                    "(CUDA only; elsewhere, or off, the torch ops run and "
                                    "integer weights are dequantized as they load)")
    pdl: str = setting("auto", "programmatic dependent launch on the decode path: each Triton "
                               "kernel starts while the previous one finishes, and one-token "
                               "projections run as a Triton GEMV that streams its weights "
                               "meanwhile, with the norm, rotary and SiLU around them fused in. "
                               "auto: on with CUDA, fused_ops and compute capability 9.0+; on: "
                               "required (start-up fails where it cannot be); off",
                       choices=PDL_MODES)
    cuda_graph_max_bs: int = setting(256, "capture decode CUDA graphs for batch sizes up to N "
                                          "(1, 2, 4, then every 8, as vLLM's one-value "
                                          "--cuda-graph-sizes N), so that a decode step is "
                                          "one graph launch instead of one launch per kernel "
                                          "(0: none; GPU only)",
                                     also=("cuda-graph-sizes",))
    prefill_graph_tokens: int = setting(1024, "capture CUDA graphs for prefills of one request "
                                              "of up to N new tokens (buckets of 64, 96, 128, "
                                              "192, 256, then every 64), so that a prompt's "
                                              "first token does not wait for the host to "
                                              "launch each kernel (0: none; GPU, triton "
                                              "backend only)")
    limit_mm_per_prompt: Optional[str] = setting(
        None, "vLLM's, a JSON object of the multimodal inputs a prompt may hold by modality: "
              "0 each ('{\"image\": 0, \"video\": 0}'), as minisgl serves a multimodal "
              "checkpoint's language model alone (its vision tower is not loaded); more is "
              "refused", json_value=True)
    language_model_only: bool = setting(
        False, "vLLM's: accepted, as what minisgl always does with a multimodal checkpoint "
               "(its language model alone)")
    compilation_config: Optional[str] = setting(
        None, "vLLM's, a JSON object: its CUDA-graph keys apply (cudagraph_capture_sizes or "
              "max_cudagraph_capture_size: decode graphs up to the largest size, as "
              "cuda_graph_max_bs; cudagraph_mode NONE: none); its torch.compile keys (level, "
              "mode, backend, ...) are accepted and change nothing: minisgl compiles no "
              "graph of torch ops, its fused kernels are Triton's; another key is refused",
        json_value=True)
    enable_deterministic_inference: bool = setting(
        False, "SGLang's (vLLM's VLLM_BATCH_INVARIANT=1 in the environment turns it on too, "
               "where no setting says otherwise): batch-invariant kernels, "
               "so that a request's tokens and log-probabilities do not depend on the "
               "requests batched with it, on how its prompt is chunked or cached, or on "
               "speculation: every "
               "projection takes a GEMM that sums in one order at any row count (no GEMV, "
               "no cuBLAS choice by row count) and every token attends through one kernel, "
               "its keys in one tiling (no split of the context); on CPU, one product and one "
               "attention call per token; tensor parallelism through the ordered all-reduce; "
               "experts through the torch path. Slower (decode 1.15-1.5x, prefill 1.7x on an "
               "H100; experts far more); 16- or 32-bit weights, not quantized ones",
        also=("batch-invariant",))
    enforce_eager: bool = setting(False, "no CUDA graphs at all: the same as "
                                         "--cuda-graph-max-bs 0 --prefill-graph-tokens 0 "
                                         "(vLLM's --enforce-eager, SGLang's "
                                         "--disable-cuda-graph)",
                                  also=("disable-cuda-graph",))
    allreduce: str = setting("auto", "tensor-parallel all-reduce: auto (symmetric-memory "
                                     "one-shot for small tensors where CUDA offers it, else "
                                     "NCCL / gloo), nccl (the process group's own), symm "
                                     "(required: start-up fails where it is unavailable; CUDA "
                                     "only) or symm-fused (symm, with each all-reduce before an "
                                     "RMSNorm fused with the residual add and the norm into one "
                                     "Triton kernel; needs fused_ops; bit-identical to symm) "
                                     "or ordered (an all-gather, the partials added in rank "
                                     "order: batch-invariant at any tp; auto's choice under "
                                     "enable_deterministic_inference)",
                             choices=ALLREDUCE_MODES,
                             alias=Alias("disable-custom-all-reduce", "nccl",
                                         "vLLM's: NCCL's all-reduce only (--allreduce nccl)"))
    tune_gemms: bool = setting(False, "time cuBLAS against cuBLASLt for every projection at "
                                      "every decode graph size at start-up and run each GEMM "
                                      "with the faster (CUDA, decode graphs and the triton "
                                      "backend only: the graphs record the choice). Off by "
                                      "default: a timed choice can differ between runs, and "
                                      "with it the bf16 rounding")
    cpu_threads: Optional[int] = setting(None, "torch threads of each rank; unset: "
                                               "OMP_NUM_THREADS where set, else the cores "
                                               "this process may use (CPU affinity, capped by "
                                               "the cgroup CPU quota) shared among the tp ranks "
                                               "(applied on the CPU device, or wherever given)")
    revision: Optional[str] = setting(None, "branch, tag or commit of a Hugging Face hub model "
                                            "id (unset: the default branch)")
    tokenizer_revision: Optional[str] = setting(
        None, "branch, tag or commit of a hub id given as --tokenizer (vLLM's; unset: the "
              "default branch)")
    download_dir: Optional[str] = setting(None, "hub cache directory that hub model ids are "
                                                "downloaded into and read from (unset: "
                                                "huggingface_hub's, under HF_HOME)")
    dist_init_method: str = "tcp://127.0.0.1:29500"  # the ranks' rendezvous
    # None: rank 0 hosts the rendezvous store at dist_init_method (one machine); else the ranks
    # join the TCP store there (node 0's launcher hosts it) under this key prefix.
    dist_store_prefix: Optional[str] = None
    dist_timeout_s: float = 60.0
    device_index: Optional[int] = None  # this rank's GPU on its node; None: its rank
    show_progress: bool = True  # a progress bar while rank 0 loads the weights

    def __post_init__(self) -> None:
        check_choices(self)
        adapters = self.lora_adapters  # parsed now: a malformed entry fails at start-up
        self.hf_override_dict  # noqa: B018 (parsed now, as the adapters)
        parse_pooler_config(self.pooler_config)
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {self.max_kv_tokens}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 (bytes), got {self.kv_cache_memory}")
        if self.kv_cache_memory is not None and self.max_kv_tokens is not None:
            raise ValueError(f"set kv_cache_memory ({self.kv_cache_memory} bytes) or "
                             f"max_kv_tokens ({self.max_kv_tokens}), not both")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0 (0: no graphs), got "
                             f"{self.cuda_graph_max_bs}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0: no graphs), got "
                             f"{self.prefill_graph_tokens}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.lora_slots:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} must be at least the "
                             f"{self.lora_slots} LoRA slots (max_loras)")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if 0 < self.max_loras < len(adapters):
            raise ValueError(f"max_loras {self.max_loras} is fewer than the {len(adapters)} "
                             f"adapters lora_modules names (each loaded adapter takes a slot)")
        compilation_graphs(self.compilation_config)  # parsed now: a bad one fails start-up
        check_no_multimodal(self.limit_mm_per_prompt)
        if self.allreduce == "symm-fused" and not self.fused_ops:
            raise ValueError("allreduce 'symm-fused' fuses the all-reduce into the Triton "
                             "RMSNorm and needs fused_ops; use 'symm' without them")
        if self.device != "auto":
            self._check_device()

    def _check_device(self) -> None:
        """The settings only a known device can judge."""
        check_allreduce_mode(self.allreduce, self.device)
        model_dtype = dtype_name(self.dtype, self.device)
        if self.lora_dtype != "auto" and dtype_name(self.lora_dtype, self.device) != model_dtype:
            raise ValueError(f"lora_dtype {self.lora_dtype!r}: adapters are held in the "
                             f"model's dtype ({model_dtype} here); pass auto or {model_dtype}")
        if self.enable_deterministic_inference:
            self._check_batch_invariant()
        if self.pdl == "on" and (self.device != "cuda" or not self.fused_ops):
            raise ValueError(f"pdl 'on' needs device 'cuda' and fused_ops (got device "
                             f"{self.device!r}, fused_ops {self.fused_ops}); use 'auto' or 'off'")
        if (self.attention_backend == "triton" and self.device != "cuda"
                and os.environ.get("TRITON_INTERPRET", "0") != "1"):
            # Off CUDA its kernels run only in Triton's interpreter (the CPU tests use it).
            raise ValueError(f"attention backend 'triton' needs device 'cuda' (got device "
                             f"{self.device!r}); use 'auto' or 'torch'")
        if self.tune_gemms and (self.device != "cuda" or self.cuda_graph_max_bs < 1
                                or self.backend_name != "triton"):
            # Graphs are captured with the Triton backend only (engine/cuda_graph.py).
            raise ValueError(f"tune_gemms tunes the decode CUDA graphs' GEMMs and needs device "
                             f"'cuda' with cuda_graph_max_bs >= 1 and the triton attention "
                             f"backend (got device {self.device!r}, cuda_graph_max_bs "
                             f"{self.cuda_graph_max_bs}, attention backend "
                             f"{self.backend_name!r})")

    def _check_batch_invariant(self) -> None:
        """The settings enable_deterministic_inference cannot hold with (the model's own
        conflict, quantized weights, is the engine's: check_batch_invariant)."""
        conflicts = [what for what, bad in (
            (f"allreduce 'nccl' at tp {self.tp} (past two ranks NCCL's order of sums "
             f"follows the tensor's size; 'auto' takes the ordered all-reduce)",
             self.allreduce == "nccl" and self.tp > 2),
            (f"allreduce {self.allreduce!r} (the one-shot sums small tensors in float32 and "
             f"rounds twice, where NCCL's large ones round once)",
             self.allreduce in ("symm", "symm-fused")),
            ("pdl 'on' (its one-row GEMV rounds otherwise than a batch's rows)",
             self.pdl == "on"),
            ("fused_ops off on CUDA (torch's row reductions, the norms', pick their split by "
             "the row count)", not self.fused_ops and self.device == "cuda"),
            (f"quantization {self.quantization!r}", self.quantization is not None))
            if bad]
        if conflicts:
            raise ValueError("enable_deterministic_inference cannot hold with "
                             + "; ".join(conflicts))

    @property
    def allreduce_mode(self) -> str:
        """The all-reduce the ranks join with: `allreduce`, but where "auto" meets
        enable_deterministic_inference, "ordered" (partials added in rank order whatever the
        tensor's size; distributed/modes.py)."""
        if self.enable_deterministic_inference and self.allreduce == "auto":
            return "ordered"
        return self.allreduce

    def for_rank(self, model_path: str, rank: int,
                 dist_init_method: Optional[str] = None) -> "EngineConfig":
        """Rank `rank`'s config: the model directory, its place among `tp` ranks, the device
        resolved (so the checks that need it run: ValueError, or for 'cuda' without a GPU) and
        the rendezvous address (None keeps it)."""
        return replace(self, model_path=model_path, tp_info=DistributedInfo(rank, self.tp),
                       device=resolve_device(self.device),
                       dist_init_method=dist_init_method or self.dist_init_method)

    @property
    def hf_override_dict(self) -> Dict[str, Any]:
        """`hf_overrides` parsed (empty where unset); ValueError where it is not a JSON
        object."""
        return json_object(self.hf_overrides, "hf_overrides", "config.json keys")

    @property
    def lora_slots(self) -> int:
        """LoRA adapter slots of the model (0: LoRA off): max_loras where set, else one per
        lora_modules adapter, at least one with enable_lora."""
        return max(self.max_loras or len(self.lora_adapters), int(self.lora_runtime))

    @property
    def lora_runtime(self) -> bool:
        """Adapters may load at run time (HTTP, LLM.add_lora): asked for by enable_lora or
        max_loras (vLLM's rule: LoRA needs its switch), not by lora_modules alone."""
        return self.enable_lora or self.max_loras > 0

    @property
    def lora_adapters(self) -> Tuple[Tuple[str, str], ...]:
        """(name, path) of each adapter of `lora_modules`, in order (slot i: the i-th):
        NAME=PATH entries separated by commas (a bare PATH names the adapter by its path, as
        SGLang's --lora-paths), or vLLM's JSON form (an object with "name" and "path", or a
        list of them); ValueError naming an entry that is none of these, or a name given
        twice."""
        text = (self.lora_modules or "").strip()
        pairs = _json_modules(text) if text.startswith(("{", "[")) else []
        for item in [] if pairs else text.split(","):
            if not item.strip():
                continue
            name, eq, path = item.strip().partition("=")
            if not eq:  # SGLang's bare path: the adapter is named by it
                name = path = item.strip()
            if not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entry {item.strip()!r} is not NAME=PATH")
            pairs.append((name.strip(), path.strip()))
        names = [n for n, _ in pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"lora_modules names {', '.join(twice)} more than once")
        return tuple(pairs)

    def context_length(self, model_max: int) -> int:
        """The context length: `max_model_len` where set, else the model's `model_max`.
        ValueError naming both when `max_model_len` is above the model's."""
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len {self.max_model_len} is above the model's context "
                             f"length {model_max}")
        return self.max_model_len

    @property
    def decode_graph_max_bs(self) -> int:
        """The largest batch a decode CUDA graph is captured for (0: none): enforce_eager's
        none, else compilation_config's where it names one, else cuda_graph_max_bs."""
        graphs = compilation_graphs(self.compilation_config)
        if self.enforce_eager:
            return 0
        return self.cuda_graph_max_bs if graphs is None else graphs

    @property
    def prefill_graph_max_tokens(self) -> int:
        """The longest one-request prefill a CUDA graph is captured for (0: none)."""
        return 0 if self.enforce_eager else self.prefill_graph_tokens

    @property
    def torch_device(self) -> torch.device:
        import torch
        device = resolve_device(self.device) if self.device == "auto" else self.device
        if device == "cuda":
            index = self.tp_info.rank if self.device_index is None else self.device_index
            return torch.device("cuda", index)
        return torch.device(device)

    @property
    def torch_dtype(self) -> torch.dtype:
        from minisgl.utils import resolve_dtype
        return resolve_dtype(self.dtype, self.torch_device.type)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype (`kv_cache_dtype` resolved against the model's)."""
        from minisgl.kvcache.pool import kv_dtype
        return kv_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device == "cuda" else "torch"


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def environment_settings(env: Mapping[str, str]) -> Dict[str, Any]:
    """The settings the environment `env` gives, for a launcher or LLM() to lay under its own
    (so that every rank and node reads one value, which the nodes' fingerprints compare):
    vLLM's VLLM_BATCH_INVARIANT, an integer as vLLM reads it (0: off), is
    enable_deterministic_inference. ValueError naming a value that is not an integer."""
    raw = env.get(BATCH_INVARIANT_ENV, "").strip()
    if not raw:
        return {}
    try:
        on = int(raw) != 0
    except ValueError:
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be an integer (1: batch-invariant "
                         f"kernels, 0: off), got {raw!r:.40}") from None
    return {"enable_deterministic_inference": on}


def _json_modules(text: str) -> List[Tuple[str, str]]:
    """vLLM's JSON form of lora_modules: {"name": ..., "path": ...} or a list of those (other
    keys, e.g. base_model_name, are vLLM's and not read); ValueError naming what is off."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_modules is not JSON: {e}") from None
    entries = value if isinstance(value, list) else [value]
    pairs = []
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("path"), str) and entry["name"] and entry["path"]):
            raise ValueError(f"lora_modules entry {entry!r:.80} has no \"name\" and "
                             f"\"path\" strings")
        pairs.append((entry["name"], entry["path"]))
    return pairs


# vLLM's compilation_config keys about torch.compile, which minisgl does not run
_COMPILE_KEYS = ("level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor",
                 "compile_sizes", "inductor_compile_config", "inductor_passes", "pass_config",
                 "full_cuda_graph", "cudagraph_num_of_warmups", "use_cudagraph",
                 "cudagraph_copy_inputs", "compile_cache_save_format", "debug_dump_path",
                 "cache_dir")
_GRAPH_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")


def compilation_graphs(text: Optional[str]) -> Optional[int]:
    """The largest decode graph vLLM's `compilation_config` asks for (0: none), or None where
    it says nothing of graphs; ValueError naming a bad value or a key minisgl does not take."""
    name = "compilation_config"
    cfg = json_object(text, name, "compilation options", (*_COMPILE_KEYS, *_GRAPH_KEYS))
    mode = cfg.get("cudagraph_mode")
    if mode is not None and not isinstance(mode, str):
        raise ValueError(f"{name}: cudagraph_mode must be a name (NONE, FULL, PIECEWISE, ...), "
                         f"got {mode!r}")
    if mode is not None and mode.upper() == "NONE":
        return 0
    sizes = cfg.get("cudagraph_capture_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes or any(
            not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes)):
        raise ValueError(f"{name}: cudagraph_capture_sizes must be a list of batch sizes >= 1, "
                         f"got {sizes!r:.80}")
    largest = cfg.get("max_cudagraph_capture_size")
    if largest is not None and (not isinstance(largest, int) or isinstance(largest, bool)
                                or largest < 0):
        raise ValueError(f"{name}: max_cudagraph_capture_size must be an integer >= 0, got "
                         f"{largest!r}")
    if largest is not None:
        return int(largest)
    return max(sizes) if sizes is not None else None


def check_no_multimodal(text: Optional[str]) -> None:
    """vLLM's limit_mm_per_prompt as minisgl serves it: every modality at 0 (a count, or
    {"count": 0}); ValueError naming a modality it allows more of."""
    name = "limit_mm_per_prompt"
    for modality, limit in json_object(text, name, "limits by modality").items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if count != 0 or isinstance(count, bool):
            raise ValueError(f"{name}: {modality} {json.dumps(limit)}: multimodal inputs are "
                             f"not served (a multimodal checkpoint's language model is): give "
                             f"0")
