"""The index audit (audit.py) over kopf-shaped indexes and a listing it is given: an object the
indexes show and the API server no longer lists is a ghost the passes no longer see, and its job
is reconciled. Pods by uid, so the ghost of a pod deleted while unwatched is found beside the pod
made again under its name (kopf keys its entries by uid); kinds indexed by name, by name."""

from __future__ import annotations

import asyncio

from accelerate_operator.audit import Audit
from accelerate_operator.pod_state import PodState

KEY = ("ml", "train")


def pod(name: str, uid: str) -> tuple[str, PodState]:
    return "job-uid", PodState(name=name, index=0, attempt=0, phase="Running", uid=uid)


def audit_of(listed: dict[str, list[tuple[str, str, str, str]]]) -> tuple[Audit, list]:
    reconciled: list = []

    async def list_owned(kind: str):
        for item in listed.get(kind, []):
            yield item

    return Audit(list_owned, reconciled.append), reconciled


def test_a_ghost_beside_a_pod_made_again_under_its_name_is_found_by_uid():
    audit, reconciled = audit_of({"Pod": [("ml", "train-0", "uid-new", "9")],
                                  "Service": [("ml", "train", "svc-uid", "3")]})
    audit.indexes = {"job_pods": {KEY: [pod("train-0", "uid-old"), pod("train-0", "uid-new")]},
                     "job_services": {KEY: ["train", "train-gone"]}}
    assert asyncio.run(audit.audit()) == 2
    assert audit.hides("Pod", "ml", "train-0", "uid-old")
    assert not audit.hides("Pod", "ml", "train-0", "uid-new")
    assert audit.hides("Service", "ml", "train-gone") and not audit.hides("Service", "ml", "train")
    assert reconciled == [KEY, KEY]


def test_an_event_of_the_same_object_clears_its_ghost_and_one_of_its_namesake_does_not():
    audit, _ = audit_of({"Pod": [("ml", "train-0", "uid-new", "9")]})
    audit.indexes = {"job_pods": {KEY: [pod("train-0", "uid-old"), pod("train-0", "uid-new")]}}
    asyncio.run(audit.audit())
    audit.seen("Pod", "MODIFIED", {"namespace": "ml", "name": "train-0", "uid": "uid-new"})
    assert audit.hides("Pod", "ml", "train-0", "uid-old")
    audit.seen("Pod", "MODIFIED", {"namespace": "ml", "name": "train-0", "uid": "uid-old"})
    assert not audit.hides("Pod", "ml", "train-0", "uid-old")
