"""`make demo` end to end: the README's main command must keep working, so the suite runs it as a user would
(its own control plane, helm install, the operator under the chart's ServiceAccount, real pod servers,
resolve by name, a supervision batch) and reads what it prints: on the HF engine (`make demo`) and on vLLM's
CPU build (`make demo ENGINE=vllm`)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.cluster import nodes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_demo_runs_end_to_end_and_cleans_up(engine):
    env = {**os.environ, "NO_PROXY": "*"}
    env.pop("KUBECONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--engine", engine],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    # The narration shows the load's progress, as the server reports it, before the target is Ready.
    progress = re.search(r"Progressing: .*quickstart-\S+: waiting for weights: no weights yet", output)
    assert progress and progress.start() < output.index("condition met"), output[-4000:]
    assert "eagle3target.eagle3.dev/quickstart condition met" in output
    # NAME READY REASON AVAILABLE READY/DESIRED ENGINE MODEL
    columns = rf"quickstart\s+True\s+AllReplicasReady\s+True\s+1/1\s+{engine}\s+tiny-llama"
    assert re.search(columns, output), output[-4000:]
    assert re.search(rf"endpoints:\s+http://127\.{nodes.POD_NET}\.\d+\.\d+:8000", output)
    assert re.search(r"aux_hidden_states\s+\(4, 128, 192\)\s+float32", output)
    assert re.search(r"logits\s+\(4, 128, 256\)\s+float32", output)
    assert re.search(r"throughput:\s+[\d,]+ tokens/s", output)
    logs = Path(re.search(r"logs kept in (\S+)", output).group(1))
    leftovers = subprocess.run(["pgrep", "-f", str(logs)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"processes of the demo still running: {leftovers}"
