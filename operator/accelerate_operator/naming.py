"""Deterministic child names: a restarted operator finds what it created before."""


def pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-{index}"


def service_name(job_name: str) -> str:
    return job_name


def configmap_name(job_name: str) -> str:
    return f"{job_name}-accelerate-config"


def master_address(job_name: str) -> str:
    """Pod 0's DNS name through the headless Service; resolvable from any pod of the namespace."""
    return f"{pod_name(job_name, 0)}.{service_name(job_name)}"


def logs_configmap_name(job_name: str, attempt: int) -> str:
    """The archived logs of the pods of `attempt`, kept when the group restarts."""
    return f"{job_name}-logs-attempt-{attempt}"
