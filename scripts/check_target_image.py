"""`make images-check`: run the target image the way its pods run it and check that it serves.

It builds the image if needed (image/build.sh target: minutes cold, so not part of `make test`), writes a tiny
random model, and runs `eagle3-target serve` with `buildah run` as the image's own numeric user on a
read-only root, with the scratch emptyDir the operator renders (HOME and TMPDIR) and the model mounted
read-only: /readyz turns 200 and one supervision request answers with hidden states. Then a server given a
model that is not there writes why to its termination log and exits. Each engine in --engines is checked
(hf, and vllm: vLLM's CPU build in the CPU variant). Prints JSON; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from eagle3_operator.constants import SCRATCH_MOUNT
from eagle3_operator.render.pod_parts import RUN_AS_USER, SCRATCH_ENV
from eagle3_target.protocol import EXIT_LOAD_FAILED
from eagle3_target.tiny import write_tiny_model
from safetensors.torch import load, save

from support.cluster.waiting import LOOPBACK, free_port
from support.containers import ReadOnlyContainer, build_image
from support.vllm_runner import CPU_ENGINE_ARGS

MODEL = "/models/tiny"
TERMINATION_LOG = f"{SCRATCH_MOUNT}/termination-log"


def serve_env() -> dict[str, str]:
    # A kubelet mounts /dev/termination-log; buildah's /dev is the host's (read-only), so the server is told
    # to write its termination message into the scratch emptyDir instead (the setting the image reads).
    env = {e["name"]: e["value"] for e in SCRATCH_ENV}
    return {**env, "HF_HUB_OFFLINE": "1", "EAGLE3_TARGET_TERMINATION_LOG": TERMINATION_LOG}


def check_serving(image: str, model_dir: Path, engine: str) -> dict[str, object]:
    port = free_port()
    argv = ["eagle3-target", "serve", "--model", MODEL, "--engine", engine, "--host", LOOPBACK]
    argv += ["--port", str(port)]
    if engine == "vllm":
        argv += [arg for key, value in CPU_ENGINE_ARGS.items() for arg in ("--engine-arg", f"{key}={value}")]
    with ReadOnlyContainer(image, writable=[SCRATCH_MOUNT], binds={model_dir: MODEL}) as ctr:
        began = time.monotonic()
        log = ctr.scratch / f"{engine}.log"  # a file: a pipe nobody reads fills up and blocks the server
        with log.open("wb") as out:
            server = subprocess.Popen(
                ctr.run_argv(argv, env=serve_env()), stdout=out, stderr=subprocess.STDOUT
            )
        try:
            url = f"http://{LOOPBACK}:{port}"
            while (status := _status(url + "/readyz")) != 200:
                if server.poll() is not None or time.monotonic() - began > 600:
                    server.kill()
                    raise AssertionError(f"{engine}: not ready ({status}):\n{log.read_text()[-4000:]}")
                time.sleep(1)
            ready_seconds = time.monotonic() - began
            ids = torch.tensor([[1, 5, 9, 42, 7]])
            response = httpx.post(url + "/v1/supervision", content=save({"input_ids": ids}), timeout=120)
            assert response.status_code == 200, response.text
            tensors = load(response.content)
            uid = _uid_listening(port)
            writes = subprocess.run(
                ctr.run_argv(["sh", "-c", "touch /home/eagle3/x 2>/dev/null || echo read-only"]),
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
        finally:
            server.terminate()
            server.wait(timeout=60)
    assert uid == RUN_AS_USER, uid
    assert writes == "read-only", writes
    return {"ready_seconds": round(ready_seconds, 1), "tensors": sorted(tensors), "uid": uid}


def check_termination_message(image: str, model_dir: Path) -> str:
    argv = ["eagle3-target", "serve", "--model", "/models/tiny/missing", "--engine", "hf", "--host", LOOPBACK]
    argv += ["--port", str(free_port())]
    with ReadOnlyContainer(image, writable=[SCRATCH_MOUNT], binds={model_dir: MODEL}) as ctr:
        # A kubelet creates the file before the container starts; the server writes only into one that exists.
        log = ctr.host_path(TERMINATION_LOG)
        log.touch()
        log.chmod(0o666)
        result = subprocess.run(
            ctr.run_argv(argv, env=serve_env()), capture_output=True, text=True, timeout=300
        )
        message = log.read_text().strip()
    assert result.returncode == EXIT_LOAD_FAILED and "does not exist" in message, (result, message)
    return message


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def _uid_listening(port: int) -> int:
    """The uid of the process listening on PORT (from /proc/net/tcp: the server inside the container)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            return int(fields[7])
    raise AssertionError(f"nothing listens on {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated engines to serve with")
    args = parser.parse_args()
    began = time.monotonic()
    image, _ = build_image("target")
    report: dict[str, object] = {"image": image, "build_or_cache_seconds": round(time.monotonic() - began, 1)}
    with tempfile.TemporaryDirectory(prefix="e3t-model-") as scratch:
        model_dir = write_tiny_model(Path(scratch) / "tiny", arch="llama", seed=0)
        # Readable for the image's user, as a model volume is for the pod's (fsGroup).
        subprocess.run(["chmod", "-R", "a+rX", scratch], check=True)
        for engine in args.engines.split(","):
            report[engine] = check_serving(image, model_dir, engine)
        report["termination_message"] = check_termination_message(image, model_dir)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
