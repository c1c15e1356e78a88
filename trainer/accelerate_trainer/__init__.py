"""The AccelerateJob trainer entrypoint: validate the accelerate config and the pod's topology,
wait for the master, then `exec` a correctly distributed `accelerate launch`."""

from .contract import CONFIG_ERROR_EXIT_CODE

__all__ = ["CONFIG_ERROR_EXIT_CODE"]
