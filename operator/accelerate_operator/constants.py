"""Names shared by the API, the builders and the handlers. No logic here."""

GROUP = "accelerate-operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AccelerateJob"
PLURAL = "acceleratejobs"

FIELD_MANAGER = "accelerate-operator"

# Labels on every child; the job-name label is how the operator finds a job's pods.
JOB_NAME_LABEL = f"{GROUP}/job-name"
NODE_INDEX_LABEL = f"{GROUP}/node-index"
ATTEMPT_LABEL = f"{GROUP}/attempt"

CONFIG_VOLUME = "accelerate-config"
CONFIG_MOUNT_PATH = "/etc/accelerate"
CONFIG_KEY = "config.yaml"
SHM_VOLUME = "dshm"

# The env every trainer container receives. Users may not set these (a CEL rule in the CRD).
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NODE_RANK = "NODE_RANK"
ENV_NUM_NODES = "NUM_NODES"
ENV_NPROC_PER_NODE = "NPROC_PER_NODE"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_CONFIG_FILE = "ACCELERATE_CONFIG_FILE"
ENV_CHECKPOINT_DIR = "ACCELERATE_CHECKPOINT_DIR"
ENV_JOB_NAME = "ACCELERATE_JOB_NAME"
# Which whole-group attempt this pod belongs to: 0, then 1 after the first restart...
ENV_JOB_ATTEMPT = "ACCELERATE_JOB_ATTEMPT"

GPU_RESOURCE = "nvidia.com/gpu"

# The trainer exits with this when its config is invalid (see accelerate_trainer): no restart
# can fix that, so it fails the job at once.
CONFIG_ERROR_EXIT_CODE = 78

# Phases and condition types, as the CRD documents them.
PENDING, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed",
)
CREATED = "Created"
FINISHED_PHASES = frozenset({SUCCEEDED, FAILED})
