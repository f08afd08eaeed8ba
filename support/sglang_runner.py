"""The SGLang runner as the CPU tests open it on real SGLang (`.venv-sglang`): fp32 on the CPU, one engine
open at a time (SGLang builds its process groups once a process), for the checkpoint asked for last.
Shared by the test modules of the runner, one rank or several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_target.runners.sglang import SGLangRunner


class OneEngine:
    """The one open SGLang engine, for the checkpoint asked for last (`engines["llama"]`): asking for another
    closes it first. `options` are `SGLangRunner.from_pretrained` keywords; `opened` lists every engine
    opened, in order."""

    def __init__(self, paths: dict[str, Path], **options: Any) -> None:
        self.paths = paths
        self.options = options
        self.name: str | None = None
        self.runner: SGLangRunner | None = None
        self.opened: list[SGLangRunner] = []

    def __getitem__(self, name: str) -> SGLangRunner:
        if name != self.name:
            self.close()
            self.runner = SGLangRunner.from_pretrained(
                self.paths[name], dtype="float32", device="cpu", **self.options
            )
            self.name = name
            self.opened.append(self.runner)
        assert self.runner is not None
        return self.runner

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner = self.name = None
