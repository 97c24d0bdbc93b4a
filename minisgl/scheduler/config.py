"""The scheduler section of the config tree: the engine's, plus batching limits and IO addresses.

Fields made by `setting` are user settings (minisgl/settings.py); the addresses are runtime
values the launcher fills in per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from minisgl.core import DEFAULT_MAX_LOGPROBS
from minisgl.engine import EngineConfig
from minisgl.scheduler.speculative import SpeculativeConfig
from minisgl.settings import Alias, check_choices, section, setting

CACHES = ("radix", "naive")
POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    engine: EngineConfig = section(EngineConfig)
    # Every rank must use the same chunk: an unset one is the minimum over ranks of their
    # devices' offline defaults.
    max_prefill_tokens: Optional[int] = setting(
        None, "tokens per prefill step (longer prompts are chunked); the server's stays at "
              "8192, as a longer chunk delays the running requests' next token; LLM()'s, unset, "
              "is the device's offline default (utils.offline_prefill_tokens: 16384 on CUDA "
              "GPUs of 70 GiB or more, A100s aside, else 8192)",
        also=("chunked-prefill-size", "max-num-batched-tokens"))
    cache: str = setting("radix", "prefix cache: radix (requests reuse the KV of prompt "
                                  "prefixes seen before) or naive (none)", choices=CACHES,
                         alias=(Alias("disable-radix-cache", "naive",
                                      "SGLang's name for --cache naive: no prefix cache"),
                                Alias("enable-prefix-caching", "radix",
                                      "vLLM's: the prefix cache, on by default (--cache radix)"),
                                Alias("no-enable-prefix-caching", "naive",
                                      "vLLM's name for --cache naive: no prefix cache")))
    overlap: Optional[bool] = setting(
        None, "plan step N+1 on the CPU while the device runs step N; unset: on with CUDA, "
              "off on CPU",
        alias=(Alias("disable-overlap", False, "the same as --no-overlap: plan each step only "
                                               "after the previous step's tokens arrive"),
               Alias("async-scheduling", True, "vLLM's name for --overlap"),
               Alias("no-async-scheduling", False, "vLLM's name for --no-overlap")))
    enable_chunked_prefill: Optional[bool] = setting(
        None, "vLLM's: prompts longer than max_prefill_tokens are always prefilled a chunk at a "
              "time here, so --enable-chunked-prefill asks for what is done and "
              "--no-enable-chunked-prefill is refused")
    mixed_steps: Optional[bool] = setting(
        None, "the running requests decode their next token in the same step as a prefill "
              "(their rows ride along the chunk), so a prompt does not stall them. On CUDA "
              "with prefill graphs, only steps that one graph replays mix (one prompt of up "
              "to prefill_graph_tokens, up to mixed_graph_rows running requests); the others "
              "run as separate prefill and decode steps. unset: on with CUDA and prefill "
              "graphs (an eager mixed step costs more than it saves there), else off")
    mixed_graph_rows: int = setting(
        64, "with mixed_steps on CUDA: capture prefill graphs that carry up to N running "
            "requests' decode rows (buckets of 8, 16, 32, ...; 0: no mixed graphs, so no "
            "step mixes where prefill graphs run)")
    scheduling_policy: str = setting(
        "fcfs", "which waiting request is admitted next: fcfs (arrival order, none overtakes) "
                "or priority (vLLM's: the lowest request `priority` first, then arrival; KV "
                "pressure retracts the lowest-priority request first); under fcfs a request "
                "with a priority other than 0 is refused", choices=POLICIES)
    decode_reserve_tokens: Optional[int] = setting(
        None, "reserve KV for at most this many output tokens per request at admission, "
              "retracting the newest requests (by priority: the least urgent; their KV goes to "
              "the prefix cache) and "
              "re-queueing them when decode outgrows the pool; unset: reserve all of "
              "max_tokens, so nothing is retracted")
    max_logprobs: int = setting(
        DEFAULT_MAX_LOGPROBS, "the most log-probabilities a request may ask for per token "
                              "(logprobs, top_logprobs, prompt_logprobs; vLLM's); -1: the "
                              "whole vocabulary")
    speculative_config: Optional[str] = setting(
        None, "vLLM's, a JSON object: speculative decoding by n-gram lookup in each request's "
              "own tokens, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}', or by a draft model of "
              "the same tokenizer, '{\"model\": PATH, \"num_speculative_tokens\": 4}', or by "
              "an EAGLE-3 head, '{\"method\": \"eagle3\", \"model\": PATH, ...}' (also "
              "disable_by_batch_size: no drafts in a step of more running requests); the tokens "
              "are those plain decoding gives, with every sampling option and grammars. Turns "
              "overlap off", json_value=True)
    speculative_algorithm: Optional[str] = setting(
        None, "SGLang's: NGRAM speculates as speculative_config's ngram does, with "
              "speculative_num_draft_tokens and the match window sizes; STANDALONE with "
              "speculative_draft_model_path's draft model, EAGLE3 with its EAGLE-3 head "
              "(other algorithms are refused by name); set this or speculative_config")
    speculative_num_draft_tokens: Optional[int] = setting(
        None, "SGLang's, with speculative_algorithm NGRAM, STANDALONE or EAGLE3: the tokens a "
              "verify step gives a request, its newest and up to N - 1 drafts")
    speculative_num_steps: Optional[int] = setting(
        None, "SGLang's, with speculative_algorithm STANDALONE or EAGLE3: the drafts per "
              "request (with speculative_num_draft_tokens, that minus 1)")
    speculative_eagle_topk: Optional[int] = setting(
        None, "SGLang's: 1, a chain of drafts (a tree, topk > 1, is refused)")
    speculative_draft_model_path: Optional[str] = setting(
        None, "SGLang's, with speculative_algorithm STANDALONE: the draft model, with EAGLE3: "
              "the EAGLE-3 head (a directory or a hub id)")
    speculative_ngram_min_match_window_size: Optional[int] = setting(
        None, "SGLang's: the shortest match an n-gram draft follows (prompt_lookup_min; "
              "default 1)")
    speculative_ngram_max_match_window_size: Optional[int] = setting(
        None, "SGLang's: the longest match an n-gram draft follows (prompt_lookup_max; "
              "default 12)")
    profile_dir: Optional[str] = setting(
        None, "where torch.profiler traces go (one per rank a start and stop: /start_profile "
              "and /stop_profile over HTTP, LLM.start_profile / stop_profile); unset: "
              "VLLM_TORCH_PROFILER_DIR or SGLANG_TORCH_PROFILER_DIR from the environment, "
              "else profiling is off")
    check_lockstep: bool = setting(False, "every step, the ranks compare their batch uids, KV "
                                          "slots and sampled tokens and fail on a mismatch (a "
                                          "debugging aid: one collective per step)")
    stats_interval: float = setting(0.5, "seconds between rank 0's pushes of the scheduler's "
                                         "state to /metrics (also while idle or in a long "
                                         "step)")
    # ZMQ addresses; None in offline single-rank mode (in-process IO).
    backend_addr: Optional[str] = None  # tokenizer -> rank 0 (PULL, rank 0 binds)
    detokenizer_addr: Optional[str] = None  # rank 0 -> detokenizer (PUSH, rank 0 connects)
    broadcast_addr: Optional[str] = None  # rank 0 -> other ranks (XPUB/SUB, rank 0 binds)
    # Rank 0 binds this one too (tcp://) for the ranks on other nodes, which connect to it.
    broadcast_remote_addr: Optional[str] = None
    subscriber_timeout_s: float = 60.0
    replica: int = 0  # which data-parallel replica this rank belongs to (in its stats)
    node_ranks: int = 0  # rank processes its launcher runs on this host (0: tp); CPU threads
    # The tokenizer grammars compile against (--tokenizer's directory); "": the model's.
    tokenizer_path: str = ""

    @property
    def mixed(self) -> bool:
        """mixed_steps resolved: where unset, on with CUDA and prefill graphs."""
        if self.mixed_steps is not None:
            return self.mixed_steps
        return self.engine.torch_device.type == "cuda" and self.engine.prefill_graph_max_tokens > 0

    @property
    def mixed_rows(self) -> int:
        """The most decode rows the engine's mixed-step graphs carry (0: mixed steps off)."""
        return self.mixed_graph_rows if self.mixed else 0

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """speculative_config parsed, or SGLang's speculative_* flags (None: no
        speculation); ValueError where both are set."""
        sglang = SpeculativeConfig.from_sglang(
            self.speculative_algorithm, self.speculative_num_draft_tokens,
            self.speculative_ngram_min_match_window_size,
            self.speculative_ngram_max_match_window_size, self.speculative_draft_model_path,
            self.speculative_num_steps, self.speculative_eagle_topk)
        if sglang is not None and self.speculative_config is not None:
            raise ValueError("set speculative_config (vLLM's) or speculative_algorithm "
                             "(SGLang's), not both")
        return sglang or SpeculativeConfig.parse(self.speculative_config)

    @property
    def resolved_profile_dir(self) -> Optional[str]:
        """profile_dir, else the environment's (vLLM's, then SGLang's variable); None: off."""
        return (self.profile_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR")
                or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or None)

    @property
    def verify_tokens(self) -> int:
        """The most new tokens a verify step gives a request (its newest and the drafts; 0: no
        speculation): what the engine's verify graphs hold."""
        spec = self.speculative
        return 0 if spec is None else 1 + spec.num_speculative_tokens

    @property
    def draft_model_path(self) -> Optional[str]:
        """The draft model speculation runs (None: none; n-gram lookup, if speculating)."""
        spec = self.speculative
        return None if spec is None else spec.model

    @property
    def draft_method(self) -> str:
        """What `draft_model_path` holds: "eagle3" (an EAGLE-3 head) or "draft_model"."""
        spec = self.speculative
        return "eagle3" if spec is not None and spec.eagle else "draft_model"

    @property
    def verify_requests(self) -> Optional[int]:
        """The most requests a verify step holds (None: no limit): past disable_by_batch_size
        running requests no step drafts."""
        spec = self.speculative
        return None if spec is None else spec.disable_by_batch_size

    def logprobs_cap(self, vocab_size: int) -> int:
        """max_logprobs resolved for a vocabulary of `vocab_size` tokens (-1: all of it)."""
        if self.max_logprobs == -1:
            return vocab_size
        return min(self.max_logprobs, vocab_size)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.enable_chunked_prefill is False:
            raise ValueError("enable_chunked_prefill false: minisgl always prefills a prompt "
                             "longer than max_prefill_tokens in chunks (raise max_prefill_tokens "
                             "for longer chunks)")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got "
                             f"{self.max_logprobs}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.mixed_graph_rows < 0:
            raise ValueError(f"mixed_graph_rows must be >= 0, got {self.mixed_graph_rows}")
        if not self.stats_interval > 0:
            raise ValueError(f"stats_interval must be > 0 seconds, got {self.stats_interval}")
        speculative = self.speculative  # ValueError naming the key
        draft_tp = None if speculative is None else speculative.draft_tensor_parallel_size
        if draft_tp is not None and draft_tp != self.engine.tp:
            raise ValueError(f"speculative_config: draft_tensor_parallel_size {draft_tp}: the "
                             f"draft model is split over the target's {self.engine.tp} "
                             f"tensor-parallel ranks (give {self.engine.tp} or leave it out)")
        if speculative is not None and self.overlap:
            raise ValueError("speculative decoding needs overlap off (a verify step reads the "
                             "newest token on the host): leave overlap unset or false")
        if self.decode_reserve_tokens is not None and self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be >= 0, got "
                             f"{self.decode_reserve_tokens}")
