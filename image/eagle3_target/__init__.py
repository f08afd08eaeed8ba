"""eagle3-target data plane: the EAGLE-3 supervision contract, target runners, wire codecs, server, client."""

__version__ = "0.1.0"
