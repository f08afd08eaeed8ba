"""The stand-in's request and result types, with vLLM 0.33's field names and defaults (the fields the runner
uses): `SamplingParams` (`vllm.sampling_params`), `Logprob` (`vllm.logprobs`), `CompletionOutput` and
`RequestOutput` (`vllm.outputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    detokenize: bool = True
    logprobs: int | None = None
    extra_args: dict[str, Any] | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None
