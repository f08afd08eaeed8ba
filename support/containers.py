"""The images `make images` builds (image/build.sh), run here with `buildah run` the way a kubelet would run
them under the pods' securityContext: as the image's own numeric user, with a read-only root filesystem and
writable directories mounted only where the rendered pods mount an emptyDir.

buildah has no read-only flag, so the container's root is bind-mounted read-only before `buildah run`. Like a
kubelet, the run bind-mounts /etc/hosts, /etc/resolv.conf and /etc/hostname, and buildah writes its marker
file under /run; those are writable mounts over the read-only root. The network is the host's (chroot
isolation), so a process inside reaches the local control plane on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from support.cluster.access import REPO
from support.operator_process import OperatorProcess

STORE = Path(
    os.environ.get("E3T_IMAGE_STORE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3-target" / "containers"
)
BUILD_SCRIPT = REPO / "image" / "build.sh"
# What buildah writes into every container it runs; a kubelet manages the same files.
RUNTIME_FILES = ("etc/hosts", "etc/resolv.conf", "etc/hostname")


def buildah(*args: str, timeout: float = 120) -> str:
    argv = ["buildah", f"--root={STORE / 'storage'}", f"--runroot={STORE / 'run'}", "--storage-driver=vfs"]
    result = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result.stdout.strip()


def build_image(what: str) -> tuple[str, str]:
    """Build (or find cached) the `operator` or `target` image; (its reference, the build's output)."""
    result = subprocess.run([str(BUILD_SCRIPT), what], capture_output=True, text=True, timeout=3600, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"image/build.sh {what} failed:\n{result.stdout}\n{result.stderr}")
    return (REPO / ".cache" / "images" / f"eagle3-{what}").read_text().strip(), result.stdout


class ReadOnlyContainer:
    """A container of IMAGE whose root is read-only; WRITABLE paths get fresh host directories (emptyDirs),
    BINDS (host path -> container path) are mounted read-only. Use as a context manager."""

    def __init__(
        self, image: str, writable: Sequence[str] = (), binds: dict[Path, str] | None = None
    ) -> None:
        self.image = image
        self.writable = list(writable)
        self.binds = dict(binds or {})
        self.scratch = Path(tempfile.mkdtemp(prefix="e3t-container-"))
        self.name = ""
        self.root = Path()
        self._mounted: list[Path] = []

    def __enter__(self) -> ReadOnlyContainer:
        self.name = buildah("from", "--quiet", "--pull-never", self.image)
        self.root = Path(buildah("mount", self.name))
        try:
            self._make_read_only()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make_read_only(self) -> None:
        # Mount points must exist before the root turns read-only.
        for path in (*RUNTIME_FILES,):
            (self.root / path).touch()
        for path in (*self.writable, *self.binds.values(), "run"):
            (self.root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self._mount("--bind", self.root, self.root)
        self._mount("-o", "remount,bind,ro", self.root, self.root)
        for index, path in enumerate(("/run", *self.writable)):
            directory = self.scratch / f"writable-{index}"
            directory.mkdir(mode=0o777)
            directory.chmod(0o777)  # an emptyDir is writable for the pod's user, whatever its uid
            self._mount("--bind", directory, self.root / path.lstrip("/"))
        for index, path in enumerate(RUNTIME_FILES):
            file = self.scratch / f"runtime-{index}"
            file.touch()
            self._mount("--bind", file, self.root / path)

    def host_path(self, path: str) -> Path:
        """Where a file under one of the WRITABLE paths lies on this machine (to read what was written)."""
        for index, writable in enumerate(self.writable, start=1):
            if path == writable or path.startswith(writable.rstrip("/") + "/"):
                return self.scratch / f"writable-{index}" / path[len(writable) :].lstrip("/")
        raise ValueError(f"{path} is not under a writable path: {self.writable}")

    def _mount(self, *args: str | Path) -> None:
        subprocess.run(["mount", *map(str, args)], check=True, capture_output=True, timeout=30)
        self._mounted.append(Path(args[-1]))

    def run_argv(self, command: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """`buildah run` of COMMAND in this container, as the image's user (for subprocess)."""
        argv = [
            "buildah",
            f"--root={STORE / 'storage'}",
            f"--runroot={STORE / 'run'}",
            "--storage-driver=vfs",
        ]
        argv += ["run", "--isolation=chroot"]
        argv += [f"--volume={host}:{inside}:ro" for host, inside in self.binds.items()]
        argv += [f"--env={key}={value}" for key, value in (env or {}).items()]
        return [*argv, self.name, "--", *command]

    def __exit__(self, *_: object) -> None:
        for path in reversed(self._mounted):
            subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
        self._mounted.clear()
        if self.name:
            buildah("umount", self.name)
            buildah("rm", self.name)
            self.name = ""


class ContainerOperator(OperatorProcess):
    """`eagle3-operator` from the operator image, in a ReadOnlyContainer (the chart's pod: /tmp writable)."""

    def __init__(self, container: ReadOnlyContainer, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.container = container

    def command(self) -> list[str]:  # type: ignore[override]  # a method here: it needs the container
        inside = {"KUBECONFIG": self.container.binds[self.kubeconfig.parent] + "/" + self.kubeconfig.name}
        return self.container.run_argv(["eagle3-operator"], env={**inside, "NO_PROXY": "*"})
