"""Activations offloaded (``offload_activations``): what a forward saves for backward, moved to
pinned host memory or NVMe and brought back ahead of the backward, on the offload runtime."""

from .offload import ActivationOffload, offload_activations

__all__ = ["ActivationOffload", "offload_activations"]
