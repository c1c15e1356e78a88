"""The AccelerateJob operator: turns one AccelerateJob into a ConfigMap, a headless Service and one
indexed Pod per node, restarts the whole group when a rank dies, and keeps the job's status true."""

__version__ = "0.1.0"
