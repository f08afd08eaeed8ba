"""`TargetClient`: pull EAGLE-3 supervision from one or more target servers, the way a trainer needs it.

The requests go through a `session.Session` (fail-over, back-off, refresh, the fingerprint pin). A body is
read into one buffer as it arrives and the tensors are views of it; a body cut short or one that does not
parse is a failure the session retries elsewhere, never a silently short tensor.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3_target.client.prefetch import prefetch
from eagle3_target.client.resolve import ResolvedTarget, follow_resource
from eagle3_target.client.runner_adapter import RemoteTargetRunner
from eagle3_target.client.session import Session
from eagle3_target.client.transport import Reply
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping
from eagle3_target.formats import batch_from_supervision
from eagle3_target.protocol import (
    FORMATS,
    LOGITS_DTYPES,
    WEIGHT_NAMES,
    FinalState,
    LayerSelection,
    TargetInfo,
    read_token_file,
)
from eagle3_target.wire import WireFormatError
from eagle3_target.wire.tensors import decode, encode


class TargetClient:
    """A keep-alive HTTP client over a target's ready endpoints, with retries, fail-over and prefetch.

    `target` is one or more server URLs (`TargetClient("http://10.0.0.5:8000")`) or the name of an
    `Eagle3Target` (`TargetClient("llama31-8b", namespace="ml-training")`): a name is resolved (waiting up
    to `wait` seconds until it is Available: some endpoint serves the current model) and its endpoints are
    re-read from the resource while running; when all of them fail and the resource says the target does
    not serve (idle, waking, restarting), the client wakes it if idle and waits for it up to `wait` seconds
    again, time not counted against `give_up_after_s`. Thread-safe. A request is retried until
    `give_up_after_s` passes (or after `max_attempts`, when given), so a trainer outlives a replica's
    restart: model loading takes minutes, far more than a fixed handful of retries.

    The bearer token is `token`, or the contents of `token_file` (not both): a file is read again when a
    request gets 401, and the request sent once more if it holds a new token, so a long run outlives the
    rotation of a mounted Secret.
    """

    def __init__(
        self,
        target: str | Iterable[str],
        *,
        namespace: str | None = None,
        wait: float = 300.0,
        kubeconfig: str | None = None,
        token: str | None = None,
        token_file: Path | str | None = None,
        timeout_s: float = 120.0,
        max_attempts: int | None = None,
        give_up_after_s: float = 300.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        allow_fingerprint_change: bool = False,
        refresh_interval_s: float = 30.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if token is not None and token_file is not None:
            raise ValueError("give the bearer token as token= or token_file=, not both")
        refresh: Callable[[float], ResolvedTarget] | None = None
        resolved: ResolvedTarget | None = None
        if isinstance(target, str) and "://" not in target:
            resolved, refresh = follow_resource(target, namespace, wait, kubeconfig)
            urls: Iterable[str] = resolved.urls
        else:
            urls = [target] if isinstance(target, str) else target
        token_path = None if token_file is None else Path(token_file)
        self._session = Session(
            urls,
            refresh=refresh,
            wait=wait,
            token=token if token_path is None else read_token_file(token_path),
            token_file=token_path,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            give_up_after_s=give_up_after_s,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            allow_fingerprint_change=allow_fingerprint_change,
            refresh_interval_s=refresh_interval_s,
            on_fingerprint_change=self._forget_target,
        )
        # What happened on the wire: requests, bytes, retries by cause, refreshes (read it, don't write it).
        self.stats = self._session.stats
        self.pool = self._session.pool
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._info: TargetInfo | None = None
        self._weights: dict[str, Tensor] = {}
        self._vocabs: dict[str, VocabMapping] = {}
        if resolved is not None:
            self._session.check_fingerprint(
                resolved.fingerprint, f"{resolved.namespace}/{resolved.name} status"
            )

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the connections. Servers are not told to shut down: they serve other trainers too."""
        self._session.close()

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint every answer so far carried (None before the first contact)."""
        return self._session.fingerprint

    # --- what the server knows -------------------------------------------------------------------------

    def info(self) -> TargetInfo:
        """GET /v1/info from some endpoint (cached): model, layers, sizes, aux ids, fingerprint."""
        with self._lock:
            if self._info is not None:
                return self._info
        info, reply = self._session.request("GET", "/v1/info", parse=_parse_info)
        self._session.check_fingerprint(info.fingerprint, reply.url)
        with self._lock:
            self._info = info
        return info

    def weight(self, name: str) -> Tensor:
        """GET /v1/weights/{name} once per fingerprint: `input_embeddings`, `lm_head` or `final_norm`."""
        if name not in WEIGHT_NAMES:
            raise ValueError(f"unknown weight {name!r}; expected one of {WEIGHT_NAMES}")
        with self._lock:
            if name in self._weights:
                return self._weights[name]
        tensors = self._tensors("GET", f"/v1/weights/{name}")
        weight = tensors["weight"].to(self.device)
        with self._lock:
            self._weights[name] = weight
        return weight

    def register_vocab(self, mapping: VocabMapping) -> str:
        """Key the draft vocabulary by its digest; each server is sent it lazily (again after restarts)."""
        digest = mapping.digest()
        with self._lock:
            self._vocabs[digest] = mapping
        return digest

    # --- supervision -----------------------------------------------------------------------------------

    def supervise(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        format: str = "hidden",
        vocab: str | VocabMapping | None = None,
        dtype: str | None = None,
    ) -> dict[str, Tensor]:
        """The raw, unshifted tensors of one format for the batch (see `protocol.FORMATS`).

        `hidden_prenorm` gives h_L before the final norm (`final_hidden_prenorm`) for trainers that apply
        the target's norm themselves (speculators); `hidden` gives it after (`final_hidden`).
        """
        if isinstance(vocab, VocabMapping):
            vocab = self.register_vocab(vocab)
        if format in FORMATS and FORMATS[format].needs_vocab and vocab is None:
            raise ValueError(f"format {format!r} needs a draft vocabulary: pass vocab= (a VocabMapping)")
        params = (
            {"format": format} | ({"vocab": vocab} if vocab else {}) | ({"dtype": dtype} if dtype else {})
        )
        return self._supervision(input_ids, attention_mask, params, vocab)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        layers: Sequence[int] | None = None,
        final: FinalState = "none",
    ) -> dict[str, Tensor]:
        """The `layers` format: any captured layers and the last hidden state, for any draft method.

        `layers` are captured layer ids (HF convention) in the order wanted, concatenated in `hidden_states`
        [B,S,n*H]; None for the whole capture set, `()` for none. `final` adds `final_hidden_prenorm`
        ("prenorm", h_L before the final norm) or `final_hidden` ("postnorm") [B,S,H]. Unshifted. Layers the
        target does not capture are refused here, before any request, naming both sets.
        """
        captured = self.info().captured_layers
        wanted = captured if layers is None else [operator.index(i) for i in layers]
        selection = LayerSelection.checked(wanted, final, captured)
        return self._supervision(input_ids, attention_mask, selection.query(), None)

    def _supervision(
        self, input_ids: Tensor, attention_mask: Tensor | None, params: dict[str, str], vocab: str | None
    ) -> dict[str, Tensor]:
        tensors = {"input_ids": input_ids.detach().to("cpu", torch.int64).contiguous()}
        if attention_mask is not None:
            tensors["attention_mask"] = attention_mask.detach().to("cpu", torch.int64).contiguous()
        body = encode(tensors)
        tensors = self._tensors("POST", "/v1/supervision", params=params, content=body, vocab=vocab)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def batch(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        loss_mask: Tensor,
        format: str = "hidden",
        mapping: VocabMapping | None = None,
    ) -> Eagle3TargetBatch:
        """The trainer's batch, identical to the in-process HF backend's (`contract.build_batch`).

        `hidden` ships the final hidden state and applies the LM head here; `draft` and `probs` need the draft
        `mapping` and rebuild `target_probs` + `position_mask`; `logits` ships the full logits.
        """
        # Half-precision models' full logits come in the model dtype, as the in-process backend has them
        # (the server's default is fp32, which every other model dtype gets).
        takes_dtype = format in FORMATS and FORMATS[format].takes_dtype
        model_dtype = self.info().dtype if takes_dtype else None
        dtype = model_dtype if model_dtype in LOGITS_DTYPES[1:] else None
        raw = self.supervise(
            input_ids,
            attention_mask,
            format=format,
            vocab=mapping if format in FORMATS and FORMATS[format].needs_vocab else None,
            dtype=dtype,
        )
        lm_head = self.weight("lm_head") if format == "hidden" else None
        device = self.device
        return batch_from_supervision(
            format,
            raw,
            input_ids.to(device),
            attention_mask.to(device),
            loss_mask.to(device),
            mapping=mapping,
            lm_head_weight=lm_head,
        )

    def prefetch(
        self,
        batches: Iterable[Mapping[str, Tensor] | tuple[Tensor, Tensor, Tensor]],
        format: str = "hidden",
        mapping: VocabMapping | None = None,
        depth: int = 2,
    ) -> Iterator[Eagle3TargetBatch]:
        """`batch()` for each (input_ids, attention_mask, loss_mask), `depth` ahead, yielded in order."""

        def fetch(item: Mapping[str, Tensor] | tuple[Tensor, Tensor, Tensor]) -> Eagle3TargetBatch:
            if isinstance(item, Mapping):
                item = (item["input_ids"], item["attention_mask"], item["loss_mask"])
            return self.batch(*item, format=format, mapping=mapping)

        return prefetch(fetch, batches, depth)

    def as_target_runner(self) -> RemoteTargetRunner:
        """NeMo AutoModel's `TargetRunner` surface over this client (see `runner_adapter`)."""
        return RemoteTargetRunner(self)

    # --- requests ------------------------------------------------------------------------------------

    def _tensors(self, method: str, path: str, vocab: str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        """A safetensors answer's tensors (views of its body), its fingerprint checked; a replica that does
        not know the draft vocabulary ``vocab`` is taught it and asked again."""
        repair = (
            None if vocab is None else functools.partial(self._register_vocab, vocab, method, path, kwargs)
        )
        (tensors, metadata), reply = self._session.request(
            method, path, parse=_parse_tensors, repair=repair, **kwargs
        )
        self._session.check_fingerprint(metadata.get("fingerprint"), reply.url)
        return tensors

    def _register_vocab(
        self, vocab: str, method: str, path: str, kwargs: dict[str, Any], url: str, _reply: Reply
    ) -> Reply | None:
        """A restarted or newly added replica: register the mapping and send the same request again."""
        mapping = self._vocabs.get(vocab)
        if mapping is None:
            return None
        self._session.count("vocab_registrations")
        body = encode({"selected_token_ids": mapping.selected_token_ids.cpu().contiguous()})
        registered = self._session.send("PUT", f"{url}/v1/vocab-mappings/{vocab}", content=body)
        if registered.refusal is not None:
            return registered
        return self._session.send(method, url + path, **kwargs)

    def _forget_target(self) -> None:
        """An accepted fingerprint change: everything cached about the old target is now wrong."""
        with self._lock:
            self._info = None
            self._weights.clear()


def _parse_info(body: memoryview) -> TargetInfo:
    return TargetInfo.model_validate_json(bytes(body))


def _parse_tensors(body: memoryview) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        return decode(body)
    except (RuntimeError, OverflowError) as exc:  # torch refusing a view the header describes
        raise WireFormatError(str(exc)) from exc
