"""The server's device-to-host staging (server/staging.py) on an accelerator: one JSON line, exit 0 only
when every check holds.

    python scripts/staging_device_check.py --device cuda      # scripts/gpu_check.sh runs this

Outputs shaped like one 8B `hidden` answer (--tokens x 4 x 4096 bf16) are made on --device by a matmul,
handed to `staging.to_host` the way the engine worker does, and checked: the host copies equal `.cpu()` of
the originals bit for bit; on CUDA they are pinned, `to_host` returns before the copy is done (the engine
thread is free for its next batch: its return time is a small share of the copy's), the next batch's kernels
run while the copy is in flight, and a steady run of answers pins no new memory after the first. On the CPU
the outputs must pass through untouched (what the tests check here).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import torch
import typer
from eagle3_target.server.staging import to_host

app = typer.Typer(add_completion=False)
HIDDEN = 4096
# to_host may take at most this share of the copy's own time (it only queues the copy).
MAX_QUEUE_SHARE = 0.25


def outputs(device: str, tokens: int, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    final = x @ weight
    return {"aux_hidden_states": torch.cat([final, x, final], dim=-1), "final_hidden": final}


def pinned_blocks_made() -> int:
    """How many blocks torch's pinned-memory allocator has had to create so far."""
    return int(torch.cuda.host_memory_stats()["num_host_alloc"])


@app.command()
def main(
    device: Annotated[str, typer.Option(help="the device under test")] = "cuda",
    tokens: Annotated[int, typer.Option()] = 8192,
    answers: Annotated[int, typer.Option()] = 6,
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16) / HIDDEN**0.5
    on_cuda = torch.device(device).type == "cuda"
    figures: dict[str, Any] = {"check": "staging-device", "device": device, "tokens": tokens}
    checks: dict[str, bool] = {}
    blocks_after_warm_up = 0
    queue_share: list[float] = []
    for answer in range(answers):
        out = outputs(device, tokens, weight)
        expected = {name: t.cpu() for name, t in out.items()} if on_cuda else dict(out)
        if on_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        host = to_host(out)
        queued = time.perf_counter() - started
        if on_cuda:
            # The next batch's work goes on the engine's stream while the copy is in flight.
            outputs(device, tokens, weight)
        started_wait = time.perf_counter()
        got = host.wait()
        copy_done = queued + time.perf_counter() - started_wait
        checks["equal"] = checks.get("equal", True) and all(
            torch.equal(got[name].view(torch.int16), expected[name].view(torch.int16)) for name in expected
        )
        if on_cuda:
            checks["pinned"] = checks.get("pinned", True) and all(t.is_pinned() for t in got.values())
            if answer:
                queue_share.append(queued / copy_done)
            del got, host
            if answer == 1:
                blocks_after_warm_up = pinned_blocks_made()
            elif answer > 1:
                checks["pinned_memory_reused"] = pinned_blocks_made() == blocks_after_warm_up
        else:
            checks["passed_through"] = (
                checks.get("passed_through", True)
                and all(got[name] is out[name] for name in out)
                and not host.pending
            )
    if on_cuda:
        figures["to_host_share_of_copy_max"] = round(max(queue_share), 4)
        checks["returns_before_the_copy_is_done"] = max(queue_share) <= MAX_QUEUE_SHARE
        figures["pinned_blocks_made"] = pinned_blocks_made()
    line = {"pass": all(checks.values())} | figures | {"checks": checks}
    print(json.dumps(line), flush=True)
    raise typer.Exit(0 if line["pass"] else 1)


if __name__ == "__main__":
    app()
