"""eagle3-target control plane: the kopf operator that reconciles Eagle3Target resources."""

__version__ = "0.1.0"
