"""The report endpoint's API calls, through kube.py's client (its threads, retries and
credentials): the API server's service-account issuer and keys (OIDC discovery, to check the
pods' tokens locally: report_tokens.py), the endpoint's TLS Secret in the operator's own
namespace, and the CA bundle in the jobs' ConfigMaps."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from .constants import FIELD_MANAGER
from .kube import ApiException, Kube
from .report_tokens import Issuer, read_issuer

# OIDC discovery, which every service account may read (the default ClusterRoleBinding
# system:service-account-issuer-discovery; the chart grants it too).
OPENID_CONFIGURATION = "/.well-known/openid-configuration"
OPENID_KEYS = "/openid/v1/jwks"
SECRETS = "/api/v1/namespaces/{}/secrets"
CONFIGMAPS = "/api/v1/namespaces/{}/configmaps"
MERGE = "application/merge-patch+json"
LIST_PAGE = 500


class ReportKube:
    def __init__(self, kube: Kube):
        self.kube = kube

    async def issuer(self) -> Issuer:
        """The API server's service-account issuer and its public keys."""
        configuration = await self.kube.request("GET", OPENID_CONFIGURATION)
        keys = await self.kube.request("GET", OPENID_KEYS,
                                       accept="application/jwk-set+json, application/json")
        return read_issuer(configuration or {}, keys or {})

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret, its data decoded, or None when there is none."""
        try:
            secret = await self.kube.request("GET", f"{SECRETS.format(namespace)}/{name}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        return {**secret, "data": data}

    async def write_secret(self, namespace: str, name: str, data: Mapping[str, str],
                           labels: Mapping[str, str], resource_version: str | None) -> bool:
        """Create the Secret (resource_version None) or replace the version read; False when
        another replica wrote first (409: read again)."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                             **({"resourceVersion": resource_version}
                                if resource_version else {})},
                "stringData": dict(data)}
        path = SECRETS.format(namespace)
        try:
            if resource_version is None:
                await self.kube.request("POST", path, body, query={"fieldManager": FIELD_MANAGER})
            else:
                await self.kube.request("PUT", f"{path}/{name}", body,
                                        query={"fieldManager": FIELD_MANAGER})
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    async def label_pod(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set (None: remove) one label of a pod."""
        await self.kube.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                {"metadata": {"labels": {key: value}}}, content_type=MERGE,
                                query={"fieldManager": FIELD_MANAGER})

    async def configmaps(self, namespaces: Iterable[str], selector: str
                         ) -> AsyncIterator[dict[str, Any]]:
        """Every ConfigMap the selector matches, in the namespaces (none: all), in pages."""
        for namespace in list(namespaces) or [None]:
            path = CONFIGMAPS.format(namespace) if namespace else "/api/v1/configmaps"
            token = None
            while True:
                page = await self.kube.request("GET", path, query={
                    "labelSelector": selector, "limit": LIST_PAGE, "continue": token})
                for item in page.get("items") or []:
                    yield item
                token = (page.get("metadata") or {}).get("continue")
                if not token:
                    break

    async def patch_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        """Merge `data` into a ConfigMap; one deleted meanwhile is no error."""
        try:
            await self.kube.request("PATCH", f"{CONFIGMAPS.format(namespace)}/{name}",
                                    {"data": dict(data)}, content_type=MERGE,
                                    query={"fieldManager": FIELD_MANAGER})
        except ApiException as error:
            if error.status != 404:
                raise
