"""The one package that talks to the API server: `Kube` (client.py) makes every request the
operator makes, through the official `kubernetes` client; paths.py says where each thing is;
errors.py what the server's answers mean; transport.py configures the client. kopf watches; the
rest of the operator is pure and tested without a cluster."""

from kubernetes.client.exceptions import ApiException

from .client import Kube
from .errors import ConfigMapMissing, NamespaceTerminating, Rejected
from .paths import METADATA_ONLY, OWNED
from .transport import client_configuration, with_retries

__all__ = ["METADATA_ONLY", "OWNED", "ApiException", "ConfigMapMissing", "Kube",
           "NamespaceTerminating", "Rejected", "client_configuration", "with_retries"]
