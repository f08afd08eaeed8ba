"""A Secret volume as the kubelet writes it, for tests of what reads a mounted Secret.

The kubelet's atomic writer puts each version of the Secret in a timestamped directory, points the `..data`
symlink at it, and makes each key a symlink through `..data`; an update writes a new directory and renames a
new `..data_tmp` link over `..data`, so a reader sees the old files or the new ones, never a mix.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

_versions = itertools.count()


class SecretVolume:
    """`directory` holds one file per key, laid out and updated as the kubelet does."""

    def __init__(self, directory: Path, **files: str) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.update(**files)

    def path(self, key: str) -> Path:
        return self.directory / key

    def update(self, **files: str) -> None:
        """Replace every key's contents at once: a new version directory, then an atomic `..data` swap."""
        data = self.directory / "..data"
        old = data.resolve() if data.is_symlink() else None
        version = self.directory / f"..2026_01_01_00_00_00.{os.getpid()}{next(_versions):06d}"
        version.mkdir()
        for key, text in files.items():
            (version / key).write_text(text)
        staged = self.directory / "..data_tmp"
        staged.symlink_to(version.name)
        staged.rename(data)
        for key in files:
            link = self.directory / key
            if not link.is_symlink():
                link.symlink_to(Path("..data") / key)
        if old is not None:
            shutil.rmtree(old)
