"""SGLang's `meta_info` of a /generate response: the finish reason as SGLang writes it, the
token counts and, with `return_logprob`, the log-probabilities as (logprob, token id, text)
triples (text null unless `return_text_in_logprobs`), RL frameworks' way of reading a rollout's
scores."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from minisgl.message.types import TokenLogprobText, WireTensor
from minisgl.server.protocol import GenerateLogprobs

Triple = List[Any]  # [logprob or None, token id, text or None]


def finish_reason(reason: Optional[str], matched: Union[None, int, str],
                  completion_tokens: int) -> Optional[Dict[str, Any]]:
    """SGLang's finish reason: {"type": "stop", "matched": the stop token id or string},
    {"type": "length", "length": tokens generated}, {"type": "abort"}; None while running."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": reason}


def logprob_fields(options: GenerateLogprobs, prompt: Sequence[TokenLogprobText],
                   output: Sequence[TokenLogprobText]) -> Dict[str, Any]:
    """The log-probability fields of `meta_info` for `prompt` (every prompt token's entry,
    the first one's logprob null; empty where none were asked) and `output` (one entry per
    output token): the prompt's from `options.start` on."""
    shown = list(prompt[options.start:]) if options.start >= 0 else []
    fields = {"input_token_logprobs": [_triple(e.logprob, e.token_id, e.token, options)
                                       for e in shown],
              "input_top_logprobs": [_tops(e, options) if e.logprob is not None else None
                                     for e in shown],
              "output_token_logprobs": [_triple(e.logprob, e.token_id, e.token, options)
                                        for e in output],
              "output_top_logprobs": [_tops(e, options) for e in output]}
    if options.ids:  # token_ids_logprob, as SGLang names them
        fields["input_token_ids_logprobs"] = [_asked(e, options) if e.logprob is not None
                                              else None for e in shown]
        fields["output_token_ids_logprobs"] = [_asked(e, options) for e in output]
    return fields


def hidden_states(rows: Optional[WireTensor], prompt_tokens: int) -> List[Any]:
    """SGLang's meta_info.hidden_states: the prompt positions' final hidden states (a list
    of rows; the last gave the first token), then one row for each later token's position
    (each gave the next token): prompt_tokens + completion_tokens - 1 rows in all."""
    if rows is None:
        return []
    values = rows.tolist()
    return [values[:prompt_tokens], *values[prompt_tokens:]]


def _triple(logprob: Optional[float], token_id: int, text: str,
            options: GenerateLogprobs) -> Triple:
    return [logprob, token_id, text if options.text else None]


def _asked(e: TokenLogprobText, options: GenerateLogprobs) -> List[Triple]:
    return [_triple(v, t, s, options) for v, t, s in
            zip(e.ids_logprobs, options.ids, e.ids_tokens)]


def _tops(e: TokenLogprobText, options: GenerateLogprobs) -> List[Triple]:
    return [_triple(v, t, s, options) for v, t, s in
            zip(e.top_logprobs[:options.top], e.top_ids, e.top_tokens)]
