"""Every message that crosses a process boundary, as plain frozen dataclasses.

Flow: API server -> tokenizer (`TokenizeRequest`, `AbortRequest`, `ReplicaChange`) -> scheduler
rank 0 (`UserMsg`, `AbortMsg`, `AdapterMsg`, `WeightsMsg`, `FlushCacheMsg`, `SleepMsg`,
`WakeMsg`, `GroupMsg`, `GroupWeightsMsg`) -> detokenizer (`TokenOut`, `BatchTokenOut`) -> API server (`ReplyChunk`). The
offline API at tp > 1 stands in for the tokenizer and detokenizer (and sends `AccountingMsg`).
Rank 0 forwards the raw bytes of backend messages verbatim to the other ranks, so a backend
message must decode to the same object on every rank (no process-local state inside).
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from minisgl.core import SamplingParams, TokenLogprobs


# --- API server -> tokenizer -------------------------------------------------------------------
@dataclass(frozen=True)
class TokenizeRequest:
    """Exactly one of `text`, `messages` (chat, JSON-like dicts) or `input_ids` is set.
    `params.max_tokens` is None when the client gave none (the tokenizer resolves it to as many
    as fit); every other message carries an integer."""

    uid: int
    params: SamplingParams
    text: Optional[str] = None
    messages: Optional[List[dict]] = None
    input_ids: Optional[List[int]] = None
    stop: Tuple[str, ...] = ()  # stop strings, matched by the detokenizer
    skip_special_tokens: bool = True
    echo: bool = False  # the reply starts with the prompt (completions' echo)
    no_stop_trim: bool = False  # a matched stop string stays in the text
    # The chat template's options, for `messages` (extra template variables as a JSON object,
    # sent as text so that no user value can look like a message on the wire).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs_json: Optional[str] = None
    tools_json: Optional[str] = None  # the tools for the chat template (a JSON list)
    # the tokenizer's special tokens (BOS) added to `text`, or to the templated messages' text
    add_special_tokens: bool = False
    tokens_as_ids: bool = False  # log-probability tokens rendered "token_id:N" (DetokenizeInit)
    return_token_ids: bool = False  # the first reply chunk carries the prompt's ids
    # a second text encoded with `text` as the tokenizer pairs two (a cross-encoder's pair)
    text_pair: Optional[str] = None
    drop_oldest: bool = False  # messages: the oldest turns dropped until the prompt fits
    stop_regex: Tuple[str, ...] = ()  # stop_regex patterns, matched by the detokenizer
    stream_interval: int = 1  # DetokenizeInit's


@dataclass(frozen=True)
class TextRequest:
    """API server -> tokenizer, nothing generated: tokenize `text` or `messages` (chat template
    applied), or detokenize `input_ids`. Answered with one final `ReplyChunk` (token ids for
    tokenize, text for detokenize) or an error."""

    uid: int
    text: Optional[str] = None
    messages: Optional[List[dict]] = None
    input_ids: Optional[List[int]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs_json: Optional[str] = None
    tools_json: Optional[str] = None  # the tools for the chat template (a JSON list)
    return_token_strs: bool = False  # tokenize: the reply's `token_strs` has each token's piece
    add_special_tokens: bool = False  # as in TokenizeRequest
    # Nothing to tokenize: the reply's `text` is the tokenizer's description as a JSON object.
    info: bool = False
    skip_special_tokens: bool = False  # detokenize: special tokens left out of the text


@dataclass(frozen=True)
class AbortRequest:
    uid: int


@dataclass(frozen=True)
class ReplicaChange:
    """API server -> tokenizer: `change` for data-parallel replica `replica`, a LoRA adapter's
    (`AdapterMsg`), the weights' (`WeightsMsg`, `GroupMsg`, `GroupWeightsMsg`,
    `TensorWeightsMsg`), the prefix
    cache's (`FlushCacheMsg`) or sleep mode's (`SleepMsg`, `WakeMsg`); the API server sends
    one per replica, each with a uid of its own, and gathers their answers."""

    replica: int
    change: Union["AdapterMsg", "WeightsMsg", "FlushCacheMsg", "SleepMsg", "WakeMsg",
                  "GroupMsg", "GroupWeightsMsg", "PauseMsg", "TensorWeightsMsg", "ProfileMsg",
                  "WeightReadMsg"]


# --- tokenizer -> scheduler (the "backend" messages rank 0 forwards to other ranks) -----------
@dataclass(frozen=True)
class UserMsg:
    uid: int
    input_ids: List[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortMsg:
    uid: int


@dataclass(frozen=True)
class ShutdownMsg:
    """Ends every rank's loop at the same step (rank 0 forwards it like any other message)."""


@dataclass(frozen=True)
class AccountingMsg:
    """The offline API (tp > 1) -> every rank at the same step: at the next rest (no work,
    nothing in flight) check the KV accounting (Scheduler.check_idle; a rank whose pages do not
    balance raises and ends), and rank 0 answers with an `AccountingReply` of the same `seq`.
    With `reset_prefix_cache`, every rank first drops its whole prefix cache (at rest no live
    request holds any of it), as `LLM.reset_prefix_cache` asks."""

    seq: int
    reset_prefix_cache: bool = False


@dataclass(frozen=True)
class AdapterMsg:
    """Load LoRA adapter `name` from PEFT directory `path` into a free slot, or unload it
    (`path` None), on every rank of a replica at the same step (rank 0 forwards it like any
    other message). A load reads the files on every rank and the ranks agree (gloo) that
    each one holds it, or none keeps it. Unloading takes the name at once (later requests
    naming it are refused); its slot stays taken until the requests that run with it finish.
    Rank 0 answers with one final `TokenOut` of `uid`: finish_reason "stop", or `error`
    saying why nothing changed. Before the request, the tokenizer sends the detokenizer a
    `DetokenizeInit` of the uid, as for a prompt."""

    uid: int
    name: str
    path: Optional[str] = None


@dataclass(frozen=True)
class WeightsMsg:
    """Reload the weights of every rank of a replica from checkpoint directory `path` (of the
    served model's architecture and shapes), as SGLang's update_weights_from_disk does; rank 0
    forwards it like any other message. From its step on, the requests that arrive wait (they
    are taken after the update, in order) while those already taken finish; then every rank
    loads, and the ranks agree (gloo) that all of them did, or every rank loads the weights it
    served before again. The prefix cache is dropped either way (its K/V came from the old
    weights). Rank 0 answers with one final `TokenOut` of `uid`: finish_reason "stop", or
    `error` saying why the weights did not change. Before the request, the tokenizer sends the
    detokenizer a `DetokenizeInit` of the uid, as for a prompt."""

    uid: int
    path: str


@dataclass(frozen=True)
class FlushCacheMsg:
    """Drop every prefix-cache page no live request holds, on every rank of a replica at the
    same step (SGLang's /flush_cache, vLLM's /reset_prefix_cache; the pages of running
    requests stay theirs). Rank 0 answers with one final `TokenOut` of `uid`, finish_reason
    "stop"; before, the tokenizer sends the detokenizer a `DetokenizeInit` of the uid."""

    uid: int


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names (MEM: tensor allocations too)


@dataclass(frozen=True)
class ProfileMsg:
    """Start (`start`) or stop torch.profiler on every rank of a replica at the same step
    (scheduler/profiler.py); the traces are named `name`. A start's options are SGLang's
    /start_profile body's: stop by itself after `num_steps` steps (None: at a stop), record
    `activities` (of PROFILE_ACTIVITIES; GPU only where there is one), each op's Python stack
    and input shapes, write into `output_dir` (a directory inside the server's profile_dir;
    None: profile_dir itself). Rank 0 answers with one final `TokenOut` of `uid`, as for a
    `FlushCacheMsg`."""

    uid: int
    start: bool
    name: str = "minisgl"
    num_steps: Optional[int] = None
    activities: Tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False
    output_dir: Optional[str] = None


@dataclass(frozen=True)
class SleepMsg:
    """Sleep mode (vLLM's /sleep, engine/sleep.py): every rank of a replica hands back its
    device memory at sleep `level` (1: the weights kept in host memory; 2: forgotten; the KV
    cache forgotten at either). Like a `WeightsMsg`, it waits for the requests already taken
    to finish, holding those that arrive; the prefix cache is dropped; the requests that arrive
    while asleep wait until a `WakeMsg` leaves nothing asleep. Rank 0 answers with one final
    `TokenOut` of `uid` (finish_reason "stop", or `error` why not); the tokenizer sends the
    detokenizer a `DetokenizeInit` of the uid first, as for a prompt."""

    uid: int
    level: int = 1
    tags: Tuple[str, ...] = ()  # the parts that sleep (SGLang's release: some); empty: all


@dataclass(frozen=True)
class WakeMsg:
    """Sleep mode (vLLM's /wake_up): every rank of a replica takes the memory of the parts
    `tags` names again ("weights", "kv_cache"; empty: both) and, once nothing is asleep,
    captures its CUDA graphs and takes the held requests. The ranks agree (gloo) that all
    woke, or each puts back to sleep what it woke. Answered as a `SleepMsg`."""

    uid: int
    tags: Tuple[str, ...] = ()


@dataclass(frozen=True)
class PauseMsg:
    """Pause generation on every rank of a replica (vLLM's /pause, SGLang's
    /pause_generation), as async RL loops do around a weight update: with `wait`, once the
    requests already taken have finished (as a `WeightsMsg` waits); else at once, the running
    requests kept where they are (their KV stays) and stepped again after a `PauseMsg` of
    `resume`. While paused, no batch runs, arriving requests are held, and reloads apply at
    once (the kept requests continue on the new weights). Answered as a `WeightsMsg`."""

    uid: int
    wait: bool = False
    resume: bool = False


@dataclass(frozen=True)
class GroupMsg:
    """Join a trainer's weight update group (SGLang's /init_weights_update_group;
    distributed/weight_group.py), or with `leave` forget it (/destroy_weights_update_group),
    on every rank of a replica at the same step: rank r of replica d joins as rank_offset +
    d * tp + r of world_size. Joining
    blocks until every member has (the trainer included); the ranks agree (gloo) that all
    joined, or none stays. Answered as a `WeightsMsg`."""

    uid: int
    group_name: str
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    backend: str = "nccl"
    leave: bool = False


@dataclass(frozen=True)
class GroupWeightsMsg:
    """Receive weights the trainer of group `group_name` broadcasts (SGLang's
    /update_weights_from_distributed): each (names[i], dtypes[i], shapes[i]) in order, whole,
    every rank keeping its shard. Waits for the live requests as a `WeightsMsg` does; the
    ranks agree that all loaded, or every rank reloads the checkpoint it served; the prefix
    cache is dropped. Answered as a `WeightsMsg`."""

    uid: int
    group_name: str
    names: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class TensorWeightsMsg:
    """Load the weights a trainer on this machine hands over by reference (SGLang's
    /update_weights_from_tensor): `payloads[r]` for tp rank r, each opened once (a payload
    carries one reference to the memory it names; distributed/tensor_payload.py: (checkpoint
    name, whole tensor) pairs, as CUDA IPC handles or shared-memory files), every rank keeping
    its shard. Waits for the live requests and is answered as a `GroupWeightsMsg`."""

    uid: int
    payloads: Tuple[bytes, ...]


# --- scheduler rank 0 -> detokenizer ------------------------------------------------------------
@dataclass(frozen=True)
class WeightReadMsg:
    """Read checkpoint tensor `name` back as every rank of a replica serves it (SGLang's
    get_weights_by_name): its first `truncate_size` rows, each rank's shard put together
    (gloo) at the same step; nothing changes. Rank 0 answers with one final `TokenOut` of
    `uid`: `tensor` the values, or `error` (a name the model does not hold, a layer kept
    quantized, more than MAX_READ_VALUES values). Before, the tokenizer sends the detokenizer a
    `DetokenizeInit` of the uid, as for a prompt."""

    uid: int
    name: str
    truncate_size: int = 100


MAX_READ_VALUES = 1 << 24  # values one WeightReadMsg answers with at most (64 MiB as float32)


@dataclass(frozen=True)
class WireTensor:
    """A tensor's values in a message: `data` holds float32 little-endian, row-major,
    `shape` says how many."""

    shape: Tuple[int, ...]
    data: bytes

    @staticmethod
    def joined(parts: Sequence[Optional["WireTensor"]]) -> Optional["WireTensor"]:
        """The parts' rows one after another ([n, ...] each, the same row shape; None parts
        skipped), in one join however many there are: a reply's hidden states are gathered
        token by token and joined once at its end. None where no part is given."""
        given = [t for t in parts if t is not None]
        if len(given) <= 1:
            return given[0] if given else None
        row = given[0].shape[1:]
        if any(t.shape[1:] != row for t in given):
            raise ValueError(f"rows of shapes {sorted({t.shape[1:] for t in given})} do not "
                             f"stack")
        return WireTensor((sum(t.shape[0] for t in given), *row),
                          b"".join(t.data for t in given))

    def tolist(self) -> Any:
        """The values as nested lists of floats (a number for shape ())."""
        flat = array("f")
        flat.frombytes(self.data)
        if sys.byteorder != "little":
            flat.byteswap()
        return _nest(flat.tolist(), self.shape)


def _nest(flat: List[float], shape: Tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds a request spent waiting for admission (queued) and from its admission to its
    first token (prefill), by rank 0's scheduler (vLLM's queue and prefill times)."""

    queued_s: float
    prefill_s: float


@dataclass(frozen=True)
class TokenOut:
    """One step's result for one request. `error` set means the request was rejected."""

    uid: int
    token: int = -1
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[str] = None
    logprobs: Optional[TokenLogprobs] = None  # when the request asked (params.logprobs)
    # With the first output token, when the request asked (params.prompt_logprobs): one per
    # prompt token after the first.
    prompt_logprobs: Optional[List[TokenLogprobs]] = None
    embedding: Optional[bytes] = None  # params.embed: float32 little-endian (StepResult)
    times: Optional[PhaseTimes] = None  # with the first output token
    # a WeightReadMsg's answer; or the final hidden states behind this token (params.
    # return_hidden_states): the first token's, every prompt position's; a later one's, one
    # row (the position it was sampled from)
    tensor: Optional[WireTensor] = None


@dataclass(frozen=True)
class SchedulerStats:
    """Rank 0's counters, for /metrics (gauges and monotonic totals), the data-parallel router
    (its load: the KV pages in use and the prompt tokens waiting) and the tokenizer's admission.
    Taken after each step and before each launch; sent with the step's replies and every
    `stats_interval` seconds (scheduler/stats_timer.py)."""

    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0  # prompt tokens of the requests not admitted yet
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_pages_cached: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefilled_tokens_total: int = 0
    # Running requests retracted to make room for the others (they wait again, their KV in the
    # prefix cache), and prefix-cache pages evicted to make room: the pool's pressure.
    retracted_requests_total: int = 0
    evicted_pages_total: int = 0
    # Forward passes by phase and the wall time each phase kept the device busy (a batch counts
    # from its launch, or from the previous batch's completion if later, to its completion).
    prefill_steps_total: int = 0
    decode_steps_total: int = 0
    prefill_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    # Time the scheduler sat waiting for the device's results: near zero means the host (Python
    # scheduling) is the bottleneck and the GPU idles between steps.
    wait_seconds_total: float = 0.0
    replica: int = 0  # the data-parallel replica whose rank 0 sent these
    # Requests rank 0 has taken from the tokenizer so far (the tokenizer's queued-token count).
    requests_received_total: int = 0
    # Numbers rank 0's stats in the order taken: stats come with replies and on a timer (two
    # sockets), and a reader keeps the latest.
    seq: int = 0
    # With LoRA slots: the adapters (by name, sorted) the admitted requests run with and those
    # the waiting ones ask for, and the slots (vLLM's lora_requests_info, which LoRA-aware
    # gateways route by)
    running_adapters: Tuple[str, ...] = ()
    waiting_adapters: Tuple[str, ...] = ()
    lora_slots: int = 0
    stats_time: float = 0.0  # time.time() when taken (lora_requests_info's value)
    # Speculative decoding (scheduler/speculative.py): verify steps (counted in the decode
    # steps too), the requests in them that had drafts, their draft tokens, those kept, and
    # those kept at each draft position (vLLM's spec_decode counters)
    spec_tokens: int = 0  # num_speculative_tokens (0: no speculation)
    verify_steps_total: int = 0
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_pos: Tuple[int, ...] = ()


@dataclass(frozen=True)
class AccountingReply:
    """Rank 0's answer to an `AccountingMsg`: scheduler.Accounting's numbers, flat (the
    scheduler converts both ways)."""

    seq: int
    free_pages: int
    in_use_pages: int
    cached_pages: int
    total_pages: int
    reserved_pages: int
    free_rows: int
    total_rows: int
    live_requests: int
    evicted_pages: int
    retracted_requests: int


@dataclass(frozen=True)
class BatchTokenOut:
    items: List[TokenOut]
    stats: Optional[SchedulerStats] = None


# --- tokenizer / detokenizer -> API server --------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprobText:
    """A `TokenLogprobs` with each token rendered as text by the detokenizer (the token on its
    own, decoded alone; "token_id:N" for a model without a tokenizer)."""

    token: str
    logprob: Optional[float]  # None only for a prompt's first token (nothing precedes it)
    top_tokens: Tuple[str, ...] = ()
    top_logprobs: Tuple[float, ...] = ()
    # The raw bytes of a token whose text alone is not them (part of a character, shown as
    # U+FFFD; tokenizer/token_bytes.py), else None: the text's UTF-8. Likewise per top token.
    token_bytes: Optional[bytes] = None
    top_bytes: Tuple[Optional[bytes], ...] = ()
    # The ids behind the texts (vLLM's prompt_logprobs are keyed by id), and the token's rank
    # (core.TokenLogprobs.rank).
    token_id: int = -1
    top_ids: Tuple[int, ...] = ()
    rank: Optional[int] = None
    # params.token_ids_logprob's log-probabilities there (core.TokenLogprobs.ids_logprobs),
    # with those tokens' texts
    ids_logprobs: Tuple[float, ...] = ()
    ids_tokens: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplyChunk:
    """Incremental output of one request; `text` is the new text since the previous chunk.
    `logprobs`, where the request asked for them, has one entry per id in `token_ids` (a stop
    token's too, though its text is not rendered)."""

    uid: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[str] = None
    error_status: int = 400
    logprobs: List[TokenLogprobText] = field(default_factory=list)
    # In the request's first chunk only: with echo, the prompt as text; with prompt
    # log-probabilities asked (params.prompt_logprobs), one entry per prompt token.
    prompt_text: Optional[str] = None
    prompt_logprobs: List[TokenLogprobText] = field(default_factory=list)
    error_param: Optional[str] = None  # the request field an error is about
    # In the final chunk of a request ended by a stop string or a stop token: which one.
    matched_stop: Union[None, int, str] = None
    token_strs: Optional[List[str]] = None  # a tokenize reply asked for the tokens' pieces
    # In the request's first chunk only, where it asked (return_token_ids): the prompt's ids.
    prompt_ids: Optional[List[int]] = None
    embedding: Optional[bytes] = None  # an embedding request's (TokenOut.embedding)
    times: Optional[PhaseTimes] = None  # with the first output token (TokenOut.times)
    # a weight read's values, or the hidden states behind the chunk's tokens (TokenOut.tensor:
    # the rows of chunks joined follow each other)
    tensor: Optional[WireTensor] = None


@dataclass(frozen=True)
class ServiceDown:
    """Launcher -> API server: a process of the service failed (`reason` names it) and the
    service is stopping; every request in flight gets an error reply, new ones are refused."""

    reason: str


@dataclass(frozen=True)
class Drain:
    """Launcher -> API server: the service is shutting down (SIGTERM). New requests get 503;
    those in flight get `timeout_s` seconds to finish, then an error reply; then the API
    server exits."""

    timeout_s: float


# --- between the API server, the tokenizer and the detokenizer ------------------------------------
@dataclass(frozen=True)
class DetokenizeInit:
    """Tokenizer -> detokenizer, sent before the request's `UserMsg` goes to rank 0.

    Tells the detokenizer how to render request `uid`: the last few prompt tokens give the
    incremental decode its left context (spacing of the first output token), `stop` strings end
    the request early (the detokenizer then sends rank 0 an `AbortMsg` so its KV pages are freed).
    The detokenizer keeps this state until rank 0's final `TokenOut` for the uid, then frees it.
    """

    uid: int
    prompt_tail: List[int]
    stop: Tuple[str, ...] = ()
    skip_special_tokens: bool = True
    # The whole prompt, when the reply echoes it or carries its log-probabilities.
    prompt_ids: Optional[List[int]] = None
    no_stop_trim: bool = False  # a matched stop string stays in the text
    echo: bool = False  # the reply starts with the prompt's text
    # vLLM's min_tokens: no stop string ends the output before more tokens than this are out
    min_tokens: int = 0
    # vLLM's return_tokens_as_token_ids: every log-probability token (prompt_logprobs' too)
    # rendered "token_id:N", as for a model without a tokenizer
    tokens_as_ids: bool = False
    return_prompt_ids: bool = False  # the first chunk carries `prompt_ids` (return_token_ids)
    stop_regex: Tuple[str, ...] = ()  # patterns that end the request as `stop` strings do
    # After the first chunk, one chunk per this many tokens (0: none until the last), each
    # holding what came since: a stream's pace (--stream-interval), or 0 where the client
    # waits for the whole reply (fewer messages to the API server).
    stream_interval: int = 1
    token_ids_logprob: Tuple[int, ...] = ()  # params'; their texts go with their logprobs


@dataclass(frozen=True)
class ReplyBatch:
    """Detokenizer (or tokenizer, for rejections) -> API server: one scheduler step's replies,
    with rank 0's counters for /metrics when the step carried them."""

    chunks: List[ReplyChunk]
    stats: Optional[SchedulerStats] = None
