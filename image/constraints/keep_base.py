"""Print the constraints an image build installs under: every distribution the base image already has (but
its packaging tools) at its installed version, so the base's vLLM, torch and CUDA libraries stay as its
release built them (a pin of ours that disagrees fails the build instead of replacing them), then our pins
for everything else.

Run inside the build with the image's python: python3 keep_base.py OUR_CONSTRAINTS > merged.txt
"""

import importlib.metadata
import re
import sys


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Packaging tools are no part of what the base is for; our pins say which setuptools torch gets.
TOOLS = {"pip", "setuptools", "wheel"}
installed = {
    canonical(d.metadata["Name"]): d.version
    for d in importlib.metadata.distributions()
    if canonical(d.metadata["Name"]) not in TOOLS
}
print("\n".join(f"{name}=={version}" for name, version in sorted(installed.items())))
with open(sys.argv[1]) as ours:
    for line in ours:
        pin = line.split("#", 1)[0].strip()
        if pin and canonical(pin.split("==", 1)[0]) not in installed:
            print(pin)
