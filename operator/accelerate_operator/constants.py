"""Names of the operator's own: the API, the field manager, volume names, phases and conditions.
No logic here. What the trainer (or a user's tooling) also reads, the env, the config mount, the
exit codes, the progress line and the label keys, is in accelerate_trainer.contract."""

GROUP = "accelerate-operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AccelerateJob"
PLURAL = "acceleratejobs"

FIELD_MANAGER = "accelerate-operator"

CONFIG_VOLUME = "accelerate-config"
SHM_VOLUME = "dshm"
CODE_VOLUME = "accelerate-code"
WORKSPACE_VOLUME = "accelerate-workspace"
REPORT_VOLUME = "accelerate-report"

# Kubernetes' name for a pod's main container (kubectl logs and exec pick it): the pod builder
# sets it to the trainer, and a mesh's injector that puts its proxy first sets it too.
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"

GPU_RESOURCE = "nvidia.com/gpu"
# The label that puts a job in a Kueue LocalQueue (kueue/ decides what that means).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# Phases and condition types, as the CRD documents them.
PENDING, QUEUED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed",
)
CREATED = "Created"
# A group that made no progress within spec.runPolicy.stallTimeoutSeconds (restarted).
STALLED = "Stalled"
# An elastic job's group runs at another size than numNodes (resize.py; reasons in elastic.py).
RESIZED = "Resized"
# A pod of the current attempt cannot start: the scheduler's or the kubelet's reason (startup.py).
WAITING = "Waiting"
FINISHED_PHASES = frozenset({SUCCEEDED, FAILED})
# In the order status.conditions lists them.
CONDITION_TYPES = (QUEUED, CREATED, WAITING, RUNNING, RESTARTING, STALLED, RESIZED, SUSPENDED,
                   SUCCEEDED, FAILED)
