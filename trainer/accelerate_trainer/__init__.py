"""The AccelerateJob trainer entrypoint: validate the accelerate config and the pod's topology,
wait for the master, then `exec` a correctly distributed `accelerate launch`."""

__all__ = ["CONFIG_ERROR_EXIT_CODE"]

# EX_CONFIG from sysexits.h: the operator treats this exit code as permanent (no restart can fix
# a bad config), so a job with a broken config fails at once instead of using up its restarts.
CONFIG_ERROR_EXIT_CODE = 78
