"""Volumes, environment and /etc/hosts for pods run by the local node agent.

Materialises volume contents under the pod's directory (configMap, secret, projected with
serviceAccountToken/configMap/secret/downwardAPI, downwardAPI, emptyDir, hostPath) and resolves
container environments the way the kubelet does ($(VAR) expansion, fieldRef, resourceFieldRef,
configMapKeyRef, secretKeyRef, envFrom). It never starts processes.
"""

from __future__ import annotations

import base64
import math
import os
import re
from decimal import Decimal

from kubeclient import ApiError, KubeClient


class NotReady(Exception):
    """A referenced object is missing: retry later (the pod stays Pending). `reason` as kubelet."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
           "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
           "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
           "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60)}


def parse_quantity(q: str | int | float) -> Decimal:
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(q).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"cannot parse quantity {q!r}")
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def _get_object(client: KubeClient, kind: str, ns: str, name: str, optional: bool) -> dict | None:
    try:
        return client.get(f"/api/v1/namespaces/{ns}/{kind}s/{name}")
    except ApiError as e:
        if e.status == 404:
            if optional:
                return None
            raise NotReady("CreateContainerConfigError", f'{kind} "{name}" not found') from None
        raise


def _data_of(obj: dict | None, kind: str) -> dict[str, bytes]:
    if obj is None:
        return {}
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def field_ref(pod: dict, path: str, pod_ip: str | None, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip or "", "status.podIPs": pod_ip or "",
        "status.hostIP": host_ip, "status.hostIPs": host_ip,
        "metadata.labels": "\n".join(f'{k}="{v}"' for k, v in (meta.get("labels") or {}).items()),
        "metadata.annotations": "\n".join(
            f'{k}="{v}"' for k, v in (meta.get("annotations") or {}).items()),
    }
    if path not in simple:
        raise NotReady("CreateContainerConfigError", f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_ref(pod: dict, ref: dict, default_container: str | None,
                 allocatable: dict[str, str]) -> str:
    cname = ref.get("containerName") or default_container
    container = next((c for c in pod["spec"]["containers"] if c["name"] == cname), {})
    kind, _, res = ref["resource"].partition(".")
    res_map = (container.get("resources") or {}).get(kind) or {}
    value = res_map.get(res) or (container.get("resources") or {}).get("limits", {}).get(res) \
        or allocatable.get(res, "0")
    divisor = parse_quantity(ref.get("divisor") or "1") or Decimal(1)  # the API defaults it to 0
    return str(math.ceil(parse_quantity(value) / divisor))


def write_files(target: str, files: dict[str, bytes], mode: int) -> None:
    for rel, content in files.items():
        path = os.path.join(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
        os.chmod(path, mode)


def _select(data: dict[str, bytes], items: list | None, default_mode: int, what: str,
            optional: bool) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {k: (v, default_mode) for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            if optional:
                continue
            raise NotReady("CreateContainerConfigError", f"key {it['key']!r} not found in {what}")
        out[it["path"]] = (data[it["key"]], it.get("mode", default_mode))
    return out


def _write_selected(target: str, sel: dict[str, tuple[bytes, int]]) -> None:
    for rel, (content, mode) in sel.items():
        write_files(target, {rel: content}, mode)


def request_token(client: KubeClient, pod: dict, audience: str | None, seconds: int | None) -> str:
    meta = pod["metadata"]
    sa = pod["spec"].get("serviceAccountName") or "default"
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [audience] if audience else [],
                     "expirationSeconds": seconds or 3607,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                        "name": meta["name"], "uid": meta["uid"]}}}
    try:
        r = client.post(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body)
    except ApiError as e:
        if e.status == 404:
            raise NotReady("CreateContainerConfigError",
                           f'serviceaccount "{sa}" not found: {e.body[:200]}') from None
        raise
    return r["status"]["token"]


def prepare_volumes(client: KubeClient, pod: dict, voldir: str, pod_ip: str | None,
                    host_ip: str, allocatable: dict[str, str]) -> dict[str, str]:
    """Write every volume of the pod; return {volume name: host path}. Raises NotReady."""
    ns = pod["metadata"]["namespace"]
    out: dict[str, str] = {}
    for v in pod["spec"].get("volumes") or []:
        name = v["name"]
        target = os.path.join(voldir, name)
        if "hostPath" in v:
            hp = v["hostPath"]
            if hp.get("type", "") in ("", "DirectoryOrCreate", "Directory") \
                    and not os.path.exists(hp["path"]):
                os.makedirs(hp["path"], exist_ok=True)
            elif hp.get("type") == "FileOrCreate" and not os.path.exists(hp["path"]):
                os.makedirs(os.path.dirname(hp["path"]), exist_ok=True)
                open(hp["path"], "a").close()
            out[name] = hp["path"]
            continue
        if "persistentVolumeClaim" in v:
            out[name] = _claim_path(client, ns, v["persistentVolumeClaim"]["claimName"])
            continue
        os.makedirs(target, exist_ok=True)
        out[name] = target
        if "emptyDir" in v:
            continue
        if "configMap" in v or "secret" in v:
            kind = "configMap" if "configMap" in v else "secret"
            src = v[kind]
            obj_name = src.get("name") or src.get("secretName")
            optional = bool(src.get("optional"))
            obj = _get_object(client, kind.lower() if kind == "secret" else "configmap", ns,
                              obj_name, optional)
            _write_selected(target, _select(_data_of(obj, kind.lower()), src.get("items"),
                                            src.get("defaultMode", 0o644), f"{kind} {obj_name}",
                                            optional))
        elif "projected" in v:
            mode = v["projected"].get("defaultMode", 0o644)
            for s in v["projected"].get("sources") or []:
                if "serviceAccountToken" in s:
                    t = s["serviceAccountToken"]
                    token = request_token(client, pod, t.get("audience"),
                                          t.get("expirationSeconds"))
                    write_files(target, {t["path"]: token.encode()}, t.get("mode", mode) or mode)
                elif "configMap" in s or "secret" in s:
                    kind = "configMap" if "configMap" in s else "secret"
                    src = s[kind]
                    optional = bool(src.get("optional"))
                    obj = _get_object(client, "configmap" if kind == "configMap" else "secret",
                                      ns, src["name"], optional)
                    _write_selected(target, _select(_data_of(obj, kind.lower()), src.get("items"),
                                                    mode, f"{kind} {src['name']}", optional))
                elif "downwardAPI" in s:
                    _write_downward(target, pod, s["downwardAPI"].get("items") or [], mode,
                                    pod_ip, host_ip, allocatable)
                else:
                    raise NotReady("CreateContainerConfigError",
                                   f"unsupported projected source {sorted(s)} in volume {name!r}")
        elif "downwardAPI" in v:
            d = v["downwardAPI"]
            _write_downward(target, pod, d.get("items") or [], d.get("defaultMode", 0o644),
                            pod_ip, host_ip, allocatable)
        else:
            kinds = sorted(k for k in v if k != "name")
            raise NotReady("CreateContainerConfigError",
                           f"the local node agent does not support volume type {kinds} "
                           f"(volume {name!r})")
    return out


def _claim_path(client: KubeClient, ns: str, claim: str) -> str:
    """Host directory of a bound claim (hostPath or local PVs, as the agent provisions)."""
    pvc = _get_object(client, "persistentvolumeclaim", ns, claim, optional=False)
    pv_name = (pvc or {}).get("spec", {}).get("volumeName")
    if not pv_name:
        raise NotReady("ContainerCreating", f'persistentvolumeclaim "{claim}" is not bound yet')
    pv = client.get(f"/api/v1/persistentvolumes/{pv_name}")
    path = (pv["spec"].get("hostPath") or pv["spec"].get("local") or {}).get("path")
    if not path:
        raise NotReady("CreateContainerConfigError",
                       f"persistentvolume {pv_name} is neither hostPath nor local: the local node "
                       f"agent can only mount host directories")
    os.makedirs(path, exist_ok=True)
    return path


def _write_downward(target: str, pod: dict, items: list, mode: int, pod_ip: str | None,
                    host_ip: str, allocatable: dict[str, str]) -> None:
    for it in items:
        if "fieldRef" in it:
            value = field_ref(pod, it["fieldRef"]["fieldPath"], pod_ip, host_ip)
        else:
            value = resource_ref(pod, it["resourceFieldRef"], None, allocatable)
        write_files(target, {it["path"]: value.encode()}, it.get("mode", mode))


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: unknown references stay as written, $$ escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, value)


def build_env(client: KubeClient, pod: dict, container: dict, base: dict[str, str],
              pod_ip: str | None, host_ip: str, allocatable: dict[str, str]) -> dict[str, str]:
    ns = pod["metadata"]["namespace"]
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src or "secretRef" in src:
            kind = "configmap" if "configMapRef" in src else "secret"
            ref = src.get("configMapRef") or src.get("secretRef")
            obj = _get_object(client, kind, ns, ref["name"], bool(ref.get("optional")))
            for k, v in _data_of(obj, kind).items():
                env[prefix + k] = v.decode(errors="replace")
    for e in container.get("env") or []:
        if "valueFrom" not in e:
            env[e["name"]] = expand(e.get("value", ""), env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            env[e["name"]] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in vf:
            env[e["name"]] = resource_ref(pod, vf["resourceFieldRef"], container["name"],
                                          allocatable)
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            kind = "configmap" if "configMapKeyRef" in vf else "secret"
            ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
            optional = bool(ref.get("optional"))
            data = _data_of(_get_object(client, kind, ns, ref["name"], optional), kind)
            if ref["key"] in data:
                env[e["name"]] = data[ref["key"]].decode(errors="replace")
            elif not optional:
                raise NotReady("CreateContainerConfigError",
                               f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
    return env


def hosts_file(pod: dict, pod_ip: str | None, peers: list[tuple[str, str, str]]) -> str:
    """/etc/hosts as the kubelet writes it, plus `peers` (ip, hostname, subdomain) of the
    namespace, which stand in for cluster DNS of headless services."""
    meta, spec = pod["metadata"], pod["spec"]
    ns = meta["namespace"]
    hostname = spec.get("hostname") or meta["name"]
    lines = ["# Kubernetes-managed hosts file (written by the local node agent).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "fe00::0\tip6-localnet", "fe00::0\tip6-mcastprefix"]
    if pod_ip:
        if spec.get("subdomain"):
            sub = spec["subdomain"]
            lines.append(f"{pod_ip}\t{hostname}.{sub}.{ns}.svc.cluster.local\t{hostname}"
                         f"\t{hostname}.{sub}\t{hostname}.{sub}.{ns}.svc")
        else:
            lines.append(f"{pod_ip}\t{hostname}")
    for alias in spec.get("hostAliases") or []:
        lines.append(f"{alias['ip']}\t" + "\t".join(alias.get("hostnames") or []))
    for ip, h, sub in peers:
        lines.append(f"{ip}\t{h}.{sub}\t{h}.{sub}.{ns}.svc\t{h}.{sub}.{ns}.svc.cluster.local")
    return "\n".join(lines) + "\n"
