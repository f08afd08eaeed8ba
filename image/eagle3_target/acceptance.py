"""What the engines' GPU acceptance suites share (`scripts/smoke_vllm.py`, `scripts/smoke_sglang.py`): the
seeded ragged batches, the comparison of an engine runner's supervision with the HF engine's on the same
device, timing, and the runner that prints one JSON line per check.

A check returns `{"pass": true|false|null, ...figures}`; null means it cannot run on this device, with the
reason, and never counts as a pass or a failure. Shipped in the package so the suites run in the images.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import typer
from torch import Tensor

from eagle3_target.runners.base import TargetRunner
from eagle3_target.runners.hf import HFRunner

SuiteT = TypeVar("SuiteT", bound="Reference")
Check = Callable[[SuiteT], dict[str, Any]]

# The command-line options every suite takes (each script's `main` adds its engine's own).
ModelOption = Annotated[Path, typer.Option(help="local model directory")]
SuiteOption = Annotated[bool, typer.Option(help="run the acceptance suite instead of one comparison")]
ChecksOption = Annotated[str, typer.Option(help="comma-separated suite checks (default: all)")]
DtypeOption = Annotated[str, typer.Option()]
DeviceOption = Annotated[str | None, typer.Option(help="default: cuda if the machine has it, else cpu")]
SeqLenOption = Annotated[int, typer.Option(help="row length (the suite scales its batches from it)")]
RepeatsOption = Annotated[int, typer.Option(help="timed calls per measurement")]
SeedOption = Annotated[int, typer.Option()]
MinArgmaxOption = Annotated[float, typer.Option(help="least top-1 agreement of the logits with HF's")]
MinCosineOption = Annotated[float, typer.Option(help="least mean cosine of each captured layer with HF's")]
EngineArgOption = Annotated[list[str] | None, typer.Option(help="the engine's KEY=VALUE, repeatable")]


def default_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def ragged_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
    """Random token ids, right-padded rows from full length down to a quarter of it."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    lengths = torch.linspace(seq_len, max(1, seq_len // 4), batch_size).round().long()
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return input_ids, mask


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(forward: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    """Result of one warm-up call and the mean wall time of `repeats` further calls."""
    result = forward()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    synchronize()
    return result, (time.perf_counter() - start) / max(1, repeats)


def layer_cosines(captured: Tensor, reference: Tensor, valid: Tensor, hidden_size: int) -> list[float]:
    """Mean cosine similarity per captured layer over the real (unpadded) positions."""
    return [
        torch.nn.functional.cosine_similarity(
            captured[..., i * hidden_size : (i + 1) * hidden_size][valid].float(),
            reference[..., i * hidden_size : (i + 1) * hidden_size][valid].float(),
            dim=-1,
        )
        .mean()
        .item()
        for i in range(captured.shape[-1] // hidden_size)
    ]


def parse_engine_args(pairs: list[str]) -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        parsed[key] = value
    return parsed


def select_checks(checks: str, known: Mapping[str, object]) -> list[str]:
    """The comma-separated `--checks` (empty: all), refused with the known names if one is unknown."""
    selected = [n.strip() for n in checks.split(",") if n.strip()] or list(known)
    unknown = sorted(set(selected) - set(known))
    if unknown:
        raise typer.BadParameter(
            f"unknown checks {unknown}; choose from {list(known)}", param_hint="--checks"
        )
    return selected


@dataclass(kw_only=True)
class Reference:
    """What every suite needs: the model, the options, and the HF reference (loaded once, on demand).
    `max_mean_logit_diff` None reports the logits' difference without gating on it."""

    model: Path
    dtype: str
    device: str
    seq_len: int
    repeats: int
    seed: int
    min_argmax: float
    min_cosine: float
    max_mean_logit_diff: float | None = None
    _hf: HFRunner | None = field(default=None, repr=False)

    def hf(self) -> HFRunner:
        if self._hf is None:
            self._hf = HFRunner.from_pretrained(self.model, dtype=self.dtype, device=self.device)
        return self._hf

    def drop_hf(self) -> None:
        """Free the reference's GPU memory before a check that needs the whole device."""
        if self._hf is not None:
            self._hf.close()
            self._hf = None

    def vocab(self) -> int:
        return int(self.hf().model.config.vocab_size)

    def num_layers(self) -> int:
        return int(self.hf().model.config.num_hidden_layers)

    def batch(self, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
        return ragged_batch(self.vocab(), batch_size, seq_len, self.seed)

    def not_on_cuda(self) -> dict[str, Any] | None:
        """The result of a CUDA-only check on another device: not run, and why (never a pass)."""
        if self.device.startswith("cuda"):
            return None
        return {"pass": None, "reason": f"needs a CUDA GPU; this run is on {self.device}"}

    def compare(self, runner: TargetRunner, input_ids: Tensor, mask: Tensor) -> dict[str, Any]:
        """An engine runner's supervision against the HF engine's on one batch: top-1 agreement of the
        logits, cosine of each captured layer and the logits' absolute difference, at the real positions."""
        hf = self.hf()
        hf.set_capture_layers(runner.capture_layer_ids)
        e_logits, e_aux = runner.forward_eagle3(input_ids, mask)
        h_logits, h_aux = hf.forward_eagle3(input_ids.to(self.device), mask.to(self.device))
        valid = mask.bool().to(self.device)
        e_logits = e_logits.to(self.device)
        argmax = (e_logits.argmax(-1) == h_logits.argmax(-1))[valid].float().mean().item()
        cosines = layer_cosines(e_aux.to(self.device), h_aux, valid, runner.model.config.hidden_size)
        diff = (e_logits[valid].float() - h_logits[valid].float()).abs()
        mean_diff = diff.mean().item()
        logits_ok = self.max_mean_logit_diff is None or mean_diff <= self.max_mean_logit_diff
        return {
            "pass": argmax >= self.min_argmax and min(cosines) >= self.min_cosine and logits_ok,
            "capture_layer_ids": runner.capture_layer_ids,
            "tokens": int(mask.sum()),
            "argmax_agreement": round(argmax, 4),
            "cosine_per_captured_layer": [round(c, 5) for c in cosines],
            "max_abs_logit_diff": float(f"{diff.max().item():.3g}"),
            "mean_abs_logit_diff": float(f"{mean_diff:.3g}"),
        }


def batch_memory(
    runner: TargetRunner, max_batch_tokens: int, seq_len: int, max_prompt_len: int
) -> dict[str, Any]:
    """Whether the runner's supervision of a full batch of `max_batch_tokens` (rows of `seq_len`, at most
    `max_prompt_len`) fits beside its engine on this GPU: its head weights and the [B,S,V] logits."""
    row = min(seq_len, max_prompt_len)
    input_ids = torch.randint(0, runner.model.config.vocab_size, (max(1, max_batch_tokens // row), row))
    torch.cuda.reset_peak_memory_stats()
    try:
        logits, _ = runner.forward_eagle3(input_ids)
        del logits
        error = None
    except torch.OutOfMemoryError as exc:
        error = str(exc).splitlines()[0]
    free, total = torch.cuda.mem_get_info()
    return {
        "pass": error is None,
        "batch_tokens": int(input_ids.numel()),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "free_gib_after": round(free / 2**30, 2),
        "total_gib": round(total / 2**30, 2),
        "error": error,
    }


def run_checks(checks: Mapping[str, Check[SuiteT]], suite: SuiteT, names: list[str]) -> bool:
    """Run the named checks in `checks` order, one JSON line each; a check that raises fails with its
    error. True when none failed (a check that cannot run on this device reports null)."""
    passed = True
    for name in [n for n in checks if n in names]:
        started = time.perf_counter()
        try:
            result = checks[name](suite)
        except Exception as exc:  # a failed check is reported, and the others still run
            result = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        line = {"check": name} | result | {"seconds": round(time.perf_counter() - started, 1)}
        print(json.dumps(line), flush=True)
        passed = passed and result["pass"] is not False
    return passed
