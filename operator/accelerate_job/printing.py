"""What `get` prints for each -o: the table (default, wide), `acceleratejob.GROUP/NAME` lines
(name), the objects whole as the API server has them (json, yaml: one object, or a List of
several as kubectl prints), or a JSONPath template applied to that same object or List. Pure:
jobs in, text out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import yaml
from accelerate_operator.constants import GROUP

from .options import Output
from .render import render_table

RESOURCE = f"acceleratejob.{GROUP}"


def as_list(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": list(jobs),
            "metadata": {"resourceVersion": ""}}


def names(jobs: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f"{RESOURCE}/{job['metadata']['name']}\n" for job in jobs)


def render_jobs(jobs: Sequence[Mapping[str, Any]], output: Output | None, now: datetime, *,
                single: bool, namespaces: bool) -> str:
    """`jobs` as `get` prints them; `single`: one job was asked for by name, so json, yaml and
    jsonpath see that object rather than a List."""
    kind = output.kind if output else ""
    if kind == "name":
        return names(jobs)
    data: Any = jobs[0] if single and len(jobs) == 1 else as_list(jobs)
    if kind == "json":
        return json.dumps(data, indent=4) + "\n"
    if kind == "yaml":
        return yaml.safe_dump(data, sort_keys=False)
    if kind == "jsonpath":
        return output.template.render(data)
    return render_table(jobs, now, namespaces=namespaces, wide=kind == "wide") + "\n"
