"""The images' constraints files pin exactly what this checkout's environment resolved for each role, so an
image installs the versions the tests ran with (scripts/image_constraints.py writes them)."""

import subprocess
import sys

from support.cluster.access import REPO


def test_constraints_files_are_current():
    result = subprocess.run(
        [sys.executable, "scripts/image_constraints.py", "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stderr


def test_each_pyproject_pin_is_in_its_roles_constraints():
    operator = (REPO / "image" / "constraints" / "operator.txt").read_text().splitlines()
    for pin in ("kopf==1.45.2", "kubernetes==37.0.2", "pydantic==2.14.4"):
        assert pin in operator
    server = (REPO / "image" / "constraints" / "server.txt").read_text().splitlines()
    assert {"torch==2.14.0", "transformers==5.20.2", "fastapi==0.136.3"} <= set(server)
