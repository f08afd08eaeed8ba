"""What one server instance holds between requests, and the few operations every route needs."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import LoadPhase
from eagle3_target.runners import InvalidInput, ModelRefused
from eagle3_target.server.activity import ActivityLog
from eagle3_target.server.batching import EngineJob, EngineWorker, QueueFull, Tensors
from eagle3_target.server.loading import (
    LoadFailed,
    LoadTracker,
    failure_line,
    one_line,
    write_termination_message,
)
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.refusals import Busy, ClientGone, Invalid, NotReady
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.staging import HostOutputs
from eagle3_target.server.streaming import AnswerMemory
from eagle3_target.server.target import LoadedTarget, load_target
from eagle3_target.server.vocab_store import LruDict, NemoMappingBindings

log = logging.getLogger(__name__)


class ServerState:
    """Settings, metrics, the engine worker, the stored vocab mappings, who pulls (activity) and (once
    loaded) the target."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.activity = ActivityLog()
        self.metrics.active_clients.set_function(self.activity.active)
        self.worker = EngineWorker(
            max_queue=settings.max_queue, max_batch_tokens=settings.max_batch_tokens, metrics=self.metrics
        )
        self.answers = AnswerMemory(
            answer_limit=settings.response_byte_limit,
            in_flight_limit=settings.in_flight_byte_limit,
            metrics=self.metrics,
        )
        self.mappings: LruDict[VocabMapping] = LruDict(settings.max_vocab_mappings)
        self.nemo_bindings = NemoMappingBindings(self.mappings)
        self.target: LoadedTarget | None = None
        self.loading = LoadTracker()
        # Called once the server can serve no more: a load failed (from the loader thread), or the engine
        # died (`require_target` finds it). The CLI stops the server then, which exits non-zero so that
        # Kubernetes restarts the pod. Embedded servers (tests) keep answering 503 with the reason instead.
        self.on_failure: Callable[[], None] = lambda: None
        self.engine_failure: str | None = None  # why the loaded engine died, once it has
        self._loader = threading.Thread(target=self._load, name="eagle3-loader", daemon=True)

    def start_loading(self) -> None:
        """Load in the background so the socket answers /healthz (and 503 on /readyz) meanwhile."""
        self._loader.start()

    def _load(self) -> None:
        log.info("loading model", extra={"model": self.settings.model, "engine": self.settings.engine})
        try:
            target = load_target(self.settings, self.loading)
        except Exception as exc:
            line = failure_line(exc)
            log.error("model load failed: %s", line, exc_info=not isinstance(exc, LoadFailed | ModelRefused))
            self._fail(line, record=lambda: self.loading.fail(line))
            return
        self.worker.start()
        self.metrics.model_info.info({k: str(v) for k, v in target.info.model_dump(mode="json").items()})
        self.target = target
        self.metrics.ready.set(1)
        log.info("ready", extra={"fingerprint": target.info.fingerprint})

    def close(self) -> None:
        self.metrics.ready.set(0)
        if self.target is not None:
            self.worker.stop()
            self.target.runner.close()

    def require_target(self) -> LoadedTarget:
        """The loaded target, or 503 with the load's phase and progress (or, after a failed load, why). A
        loaded target whose engine has died is 503 with why, for good: /readyz fails, and the server stops
        (`on_failure`) the first time a request or probe finds it, so the pod is restarted."""
        if self.target is not None:
            failure = self.engine_failure or self.target.runner.failure
            if failure is None:
                return self.target
            if self.engine_failure is None:
                self._engine_died(failure)
            raise NotReady(f"the engine has failed: {failure}")
        progress = self.loading.snapshot()
        details: dict[str, object] = {"loading": progress.model_dump(mode="json")}
        if progress.phase is LoadPhase.FAILED:
            raise NotReady(f"model failed to load: {progress.message}", details=details)
        raise NotReady(f"model is loading: {progress.message}", retry_after_s=5, details=details)

    def _engine_died(self, failure: str) -> None:
        line = one_line(f"the engine failed: {failure}; the server exits so that it is restarted")
        log.error(line)

        def record() -> None:
            self.engine_failure = failure
            self.metrics.ready.set(0)

        self._fail(line, record)

    def _fail(self, line: str, record: Callable[[], None]) -> None:
        """The server can serve no more: ``line`` goes to the termination log (what Kubernetes shows as the
        reason) before ``record`` makes the failure visible to requests and probes, then the CLI stops."""
        write_termination_message(self.settings.termination_log, line)
        record()
        self.on_failure()

    async def run_on_engine(self, job: EngineJob, gone: Callable[[], Awaitable[None]]) -> Tensors:
        """Queue ``job`` for the engine thread (`Busy` when full) and await its own rows of the result, on
        the host (a device-to-host copy still in flight is waited for on a pool thread, not the event loop).

        A client that leaves while its job waits (``gone()`` returns: `disconnected` for an HTTP request)
        takes the job out of the queue (`ClientGone`): nobody would read its answer. The server validates
        first, but an engine can be stricter (vLLM's row length): what a runner refuses as ``InvalidInput``
        is the client's fault (`Invalid`). Any other exception is the server's and reaches the app's
        catch-all handler (500, traceback logged).
        """
        try:
            future = self.worker.submit(job)
        except QueueFull as exc:
            raise Busy(str(exc), retry_after_s=1) from exc
        computed = asyncio.wrap_future(future)
        left = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((computed, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            computed.cancel()  # nothing once done; else the worker drops the job unless it has begun it
        if computed.cancelled():
            raise ClientGone("the client closed the connection while its request waited for the engine")
        try:
            outputs: HostOutputs = computed.result()
        except InvalidInput as exc:
            raise Invalid(f"the engine refused the batch: {exc}") from exc
        return await run_in_threadpool(outputs.wait) if outputs.pending else outputs.tensors


async def disconnected(request: Request) -> None:
    """Returns once the client of ``request`` has gone (its body must have been read: only then does
    receiving wait for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
