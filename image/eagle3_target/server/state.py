"""What one server instance holds between requests, and the few operations every route needs."""

from __future__ import annotations

import asyncio
import logging
import threading

from eagle3_target.contract import VocabMapping
from eagle3_target.runners import InvalidInput
from eagle3_target.server.batching import EngineJob, EngineWorker, Tensors
from eagle3_target.server.errors import NotReady, Unprocessable
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.target import LoadedTarget, load_target
from eagle3_target.server.vocab_store import LruDict, NemoMappingBindings

log = logging.getLogger(__name__)


class ServerState:
    """Settings, metrics, the engine worker, the stored vocab mappings and (once loaded) the target."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(
            max_queue=settings.max_queue, max_batch_tokens=settings.max_batch_tokens, metrics=self.metrics
        )
        self.mappings: LruDict[VocabMapping] = LruDict(settings.max_vocab_mappings)
        self.nemo_bindings = NemoMappingBindings()
        self.target: LoadedTarget | None = None
        self.load_error: str | None = None
        self._loader = threading.Thread(target=self._load, name="eagle3-loader", daemon=True)

    def start_loading(self) -> None:
        """Load in the background so the socket answers /healthz (and 503 on /readyz) meanwhile."""
        self._loader.start()

    def _load(self) -> None:
        log.info("loading model", extra={"model": self.settings.model, "engine": self.settings.engine})
        try:
            target = load_target(self.settings)
        except Exception as exc:
            log.exception("model load or canary failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        self.worker.start()
        self.metrics.model_info.info({k: str(v) for k, v in target.info.model_dump(mode="json").items()})
        self.target = target
        self.metrics.ready.set(1)
        log.info("ready", extra={"fingerprint": target.fingerprint})

    def close(self) -> None:
        self.metrics.ready.set(0)
        if self.target is not None:
            self.worker.stop()
            self.target.runner.close()

    def require_target(self) -> LoadedTarget:
        """The loaded target, or 503 while loading (or after a failed load, with its reason)."""
        if self.target is not None:
            return self.target
        if self.load_error is not None:
            raise NotReady(f"model failed to load: {self.load_error}")
        raise NotReady("model is loading", headers={"Retry-After": "5"})

    async def run_on_engine(self, job: EngineJob) -> Tensors:
        """Queue ``job`` for the engine thread (429 when full) and await its own rows of the result.

        The server validates first, but an engine can be stricter (vLLM's row length): what a runner
        refuses as ``InvalidInput`` is the client's fault (422). Any other exception is the server's and
        reaches the app's catch-all handler (500, traceback logged).
        """
        try:
            return await asyncio.wrap_future(self.worker.submit(job))
        except InvalidInput as exc:
            raise Unprocessable(f"the engine refused the batch: {exc}") from exc
