"""`TargetClient`: pull EAGLE-3 supervision from one or more target servers, the way a trainer needs it.

Every supervision request is idempotent (a pure function of the batch and the target's fingerprint), so a
request that fails on one endpoint is simply sent again to another: the caller gets each batch exactly once,
from whichever replica answered, and a checked fingerprint guarantees all answers come from the same model.
A body is read into one buffer as it arrives and the tensors are views of it; a body cut short or one that
does not parse is such a failure too, never a silently short tensor.
"""

from __future__ import annotations

import email.utils
import itertools
import json
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from eagle3_target.client.endpoints import EndpointPool
from eagle3_target.client.errors import FingerprintChanged, RequestRejected, ResolveError, TargetUnavailable
from eagle3_target.client.identity import client_id
from eagle3_target.client.prefetch import prefetch
from eagle3_target.client.resolve import ResolvedTarget, follow_resource
from eagle3_target.client.runner_adapter import RemoteTargetRunner
from eagle3_target.client.transport import Reply, Transport, TransportError
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping
from eagle3_target.formats import batch_from_supervision
from eagle3_target.protocol import (
    CLIENT_HEADER,
    FORMATS,
    LOGITS_DTYPES,
    WEIGHT_NAMES,
    FinalState,
    LayerSelection,
    TargetInfo,
    TokenFileError,
    read_token_file,
)
from eagle3_target.wire import WireFormatError
from eagle3_target.wire.tensors import decode, encode

RETRYABLE_STATUS = (429, 503)
T = TypeVar("T")


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
        self._token_file = None if token_file is None else Path(token_file)
        self._token = token if self._token_file is None else read_token_file(self._token_file)
        self._refresh: Callable[[float], ResolvedTarget] | None = None
        resolved: ResolvedTarget | None = None
        if isinstance(target, str) and "://" not in target:
            resolved, self._refresh = follow_resource(target, namespace, wait, kubeconfig)
            urls: Iterable[str] = resolved.urls
        else:
            urls = [target] if isinstance(target, str) else target
        self.pool = EndpointPool(urls, backoff_initial_s, backoff_max_s)
        # The endpoints are in-cluster peers, reached directly (never through an ambient proxy).
        self._transport = Transport(
            {CLIENT_HEADER: client_id()}, timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 10.0)
        )
        self.max_attempts = max_attempts
        self.give_up_after_s = give_up_after_s
        self.allow_fingerprint_change = allow_fingerprint_change
        self.device = torch.device(device)
        # What happened on the wire: requests, bytes, retries by cause, refreshes (read it, don't write it).
        self.stats: Counter[str] = Counter()
        self._wait = wait
        self._refresh_interval_s = refresh_interval_s
        self._last_refresh = time.monotonic()
        self._refresh_problem: str | None = None  # why the last refresh found no serving target
        self._refresh_lock = threading.Lock()  # one thread re-reads the resource (and waits), not each
        self._lock = threading.RLock()
        self._fingerprint: str | None = None
        self._info: TargetInfo | None = None
        self._weights: dict[str, Tensor] = {}
        self._vocabs: dict[str, VocabMapping] = {}
        if resolved is not None:
            self._check_fingerprint(resolved.fingerprint, f"{resolved.namespace}/{resolved.name} status")

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the connections. Servers are not told to shut down: they serve other trainers too."""
        self._transport.close()

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint every answer so far carried (None before the first contact)."""
        return self._fingerprint

    # --- what the server knows -------------------------------------------------------------------------

    def info(self) -> TargetInfo:
        """GET /v1/info from some endpoint (cached): model, layers, sizes, aux ids, fingerprint."""
        with self._lock:
            if self._info is not None:
                return self._info
        info, url = self._request("GET", "/v1/info", parse=_parse_info)
        self._check_fingerprint(info.fingerprint, url)
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

    # --- the request loop ------------------------------------------------------------------------------

    def _tensors(self, method: str, path: str, **kwargs: Any) -> dict[str, Tensor]:
        """A safetensors answer's tensors (views of its body), its fingerprint checked."""
        (tensors, metadata), url = self._request(method, path, parse=_parse_tensors, **kwargs)
        fingerprint = metadata.get("fingerprint")
        if fingerprint is not None:
            self._check_fingerprint(fingerprint, url)
        return tensors

    def _request(
        self,
        method: str,
        path: str,
        *,
        parse: Callable[[memoryview], T],
        vocab: str | None = None,
        **kwargs: Any,
    ) -> tuple[T, str]:
        """Send until an endpoint answers 2xx with a body that ``parse`` accepts: fail over on connection
        errors (a body cut short among them), 429, 503 and unparseable bodies, with back-off. Returns the
        parsed body and the URL that answered."""
        started = time.monotonic()
        give_up_at = started + self.give_up_after_s
        last_problem, attempts = "no attempt made", 0
        for attempt in range(self.max_attempts) if self.max_attempts is not None else itertools.count():
            give_up_at += self._maybe_refresh(force=attempt > 0 and self.pool.all_cooling())
            url, wait = self.pool.pick()
            if wait > give_up_at - time.monotonic():
                break
            if wait > 0:
                time.sleep(wait)
            self._count("requests")
            attempts += 1
            try:
                reply = self._send(method, url, path, vocab, kwargs)
            except TransportError as exc:
                self._count("connection_errors")
                last_problem = f"{url}: {type(exc).__name__}: {exc}"
                self.pool.failed(url)
                continue
            if reply.status_code in RETRYABLE_STATUS:
                self._count(f"status_{reply.status_code}")
                last_problem = f"{url}: HTTP {reply.status_code} {_error_text(reply)}"
                self.pool.failed(url, _retry_after_s(reply))
                continue
            if reply.status_code >= 400:
                raise RequestRejected(reply.status_code, _error_type(reply), _error_text(reply))
            try:
                parsed = parse(reply.body)
            except ValueError as exc:  # WireFormatError and pydantic's ValidationError among them
                self._count("corrupt_responses")
                last_problem = f"{url}: unreadable answer: {exc}"
                self.pool.failed(url)
                continue
            self.pool.succeeded(url)
            self._count("bytes_received", reply.body.nbytes)
            return parsed, reply.url
        resource = f"; the resource: {self._refresh_problem}" if self._refresh_problem else ""
        raise TargetUnavailable(
            f"{method} {path} failed on every endpoint of {list(self.pool.urls)} after "
            f"{attempts} attempts in {time.monotonic() - started:.1f}s; last: {last_problem}{resource}"
        )

    def _send(self, method: str, url: str, path: str, vocab: str | None, kwargs: dict[str, Any]) -> Reply:
        """One attempt on one endpoint; teaches it the draft vocabulary first if it does not know it yet."""
        reply = self._authorized(method, url + path, kwargs)
        mapping = self._vocabs.get(vocab) if vocab else None
        if reply.status_code == 404 and mapping is not None and _error_type(reply) == "not_found":
            # A restarted or newly added replica: register the mapping and send the same batch again.
            self._count("vocab_registrations")
            body = encode({"selected_token_ids": mapping.selected_token_ids.cpu().contiguous()})
            registered = self._authorized("PUT", f"{url}/v1/vocab-mappings/{vocab}", {"content": body})
            if registered.status_code >= 400:
                return registered
            reply = self._authorized(method, url + path, kwargs)
        return reply

    def _authorized(self, method: str, url: str, kwargs: dict[str, Any]) -> Reply:
        """One request with the current bearer token; a 401 re-reads the token file, and a new token there
        sends the request once more (a rotated Secret), else the 401 stands."""
        token = self._token
        reply = self._transport.request(method, url, headers=_bearer(token), **kwargs)
        if reply.status_code == 401 and self._renew_token(token):
            self._count("token_reloads")
            reply = self._transport.request(method, url, headers=_bearer(self._token), **kwargs)
        return reply

    def _renew_token(self, sent: str | None) -> bool:
        """Whether the token file now holds a token other than `sent` (then it is the client's token)."""
        if self._token_file is None:
            return False
        with self._lock:
            if self._token != sent:  # another thread renewed it meanwhile
                return True
            try:
                token = read_token_file(self._token_file)
            except TokenFileError:
                return False  # a file between two versions: the 401 stands, the next request reads again
            if token == sent:
                return False
            self._token = token
            return True

    def _check_fingerprint(self, fingerprint: str | None, source: str) -> None:
        """Pin the first fingerprint seen; a different one later is a different target."""
        if fingerprint is None:
            return
        with self._lock:
            if self._fingerprint is None or self._fingerprint == fingerprint:
                self._fingerprint = fingerprint
                return
            if not self.allow_fingerprint_change:
                raise FingerprintChanged(self._fingerprint, fingerprint, source)
            # Accepted change: everything cached about the old target is now wrong.
            self._count("fingerprint_changes")
            self._fingerprint = fingerprint
            self._info = None
            self._weights.clear()

    def _count(self, event: str, amount: int = 1) -> None:
        with self._lock:
            self.stats[event] += amount

    def _maybe_refresh(self, force: bool) -> float:
        """Re-read the endpoints from the resource every refresh interval, or at once when all are failing;
        then a target that does not serve is woken if idle and waited for up to `wait` seconds, as at the
        start. Returns the seconds this waited for a target that serves again (not counted against
        `give_up_after_s`: a wake takes scheduling and a model load)."""
        if self._refresh is None:
            return 0.0
        entered = time.monotonic()
        with self._lock:
            if not (force or entered - self._last_refresh >= self._refresh_interval_s):
                return 0.0
            seen = self._last_refresh  # moves on every refresh: a thread that waited for another's sees it
        with self._refresh_lock:
            with self._lock:
                if self._last_refresh != seen:  # another thread refreshed (and waited) meanwhile
                    return time.monotonic() - entered if self._refresh_problem is None else 0.0
            try:
                target = self._refresh(self._wait if force else 0.0)
            except ResolveError as exc:
                self._count("refresh_failures")
                self._note_refresh(problem=str(exc))
                return 0.0  # Not serving (or the API server is away): keep trying the endpoints we know.
            self._note_refresh(problem=None)
            self._count("refreshes")
            self._check_fingerprint(target.fingerprint, f"{target.namespace}/{target.name} status")
            if target.urls:
                self.pool.replace(target.urls)
        return time.monotonic() - entered

    def _note_refresh(self, problem: str | None) -> None:
        with self._lock:
            self._last_refresh = time.monotonic()
            self._refresh_problem = problem


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _parse_info(body: memoryview) -> TargetInfo:
    return TargetInfo.model_validate_json(bytes(body))


def _parse_tensors(body: memoryview) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        return decode(body)
    except (RuntimeError, OverflowError) as exc:  # torch refusing a view the header describes
        raise WireFormatError(str(exc)) from exc


def _error(reply: Reply) -> Any:
    return json.loads(bytes(reply.body))["error"]


def _error_type(reply: Reply) -> str:
    try:
        return str(_error(reply)["type"])
    except (ValueError, KeyError, TypeError):
        return "http_error"


def _error_text(reply: Reply) -> str:
    try:
        return str(_error(reply)["message"])
    except (ValueError, KeyError, TypeError):
        return bytes(reply.body[:200]).decode("utf-8", "replace")


def _retry_after_s(reply: Reply) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date), or None when absent or unreadable."""
    value = reply.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
