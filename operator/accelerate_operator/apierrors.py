"""How the API server explains a refusal: the message out of an ApiException's JSON body.

Pure (reads the exception's fields, imports nothing of the kubernetes package); shared by the
operator's kube/ and the accelerate_job client's request layer, which both report it."""

from __future__ import annotations

import json
from typing import Any


def server_message(error: Any) -> str:
    """The Status message the server sent, else the HTTP reason."""
    try:
        return json.loads(error.body).get("message") or error.reason
    except (TypeError, ValueError, AttributeError):
        return str(error.reason or error)
