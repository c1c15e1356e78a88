"""Why a launch failed, from what the processes wrote themselves (error_files.py) and the cgroup's
own counters (cgroup_memory.py): the first failing rank's error line and the few traceback lines
above it, python's own line for a script it could not open, the signal that killed a rank, out
of memory, or a rendezvous that never formed. Pure: records in, a RootCause out.

Which rank failed first: torch's rule (ChildFailedError.get_first_failure, the smallest
timestamp), on the microsecond time the hook writes where there is one, and leaving out ranks
ended by SIGTERM: torchrun's agent stops the survivors of a failed rank with it, so they are
never the cause while another rank failed on its own.

A rank whose own error is a lost peer (gloo's "Connection closed by peer", NCCL's remote error)
failed because another rank went away, often in another pod (killed for memory, by a signal):
that is a symptom, reported with reason PeerLost, so that the pod whose rank died is the one the
job's failure opens with (supervise.py lets it report first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .command import ENV_RENDEZVOUS_TIMEOUT
from .contract import EXIT_REASONS

FRAMES = 2  # traceback frames kept above the error line: the failing call and its caller
LIBRARY_PATHS = ("/site-packages/", "/dist-packages/", "/lib/python3")
MAX_CHARS = 1000
# Why, when it is known (the report's `reason`; names as Kubernetes and torch say them).
OOM_KILLED, RENDEZVOUS_TIMEOUT, RENDEZVOUS_FAILED, PEER_LOST = EXIT_REASONS
# What a rank's error says when a peer went away under it (gloo over TCP, NCCL, the TCP store).
PEER_LOST_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "remote process exited", "ncclRemoteError")
# torch.distributed.elastic.rendezvous' errors (c10d), in the order they are looked for. A static
# rendezvous is a TCPStore that waits for its peers up to the timeout: pod 0's store raises
# DistStoreError ("waiting for clients"), another pod's client DistNetworkError (connecting);
# both DistError, which the launcher raises only there, before any rank runs.
RENDEZVOUS_ERRORS = {"RendezvousTimeoutError": RENDEZVOUS_TIMEOUT,
                     "RendezvousError": RENDEZVOUS_FAILED,
                     "DistError": RENDEZVOUS_TIMEOUT}


@dataclass(frozen=True)
class RootCause:
    text: str
    rank: int | None = None
    signal: str | None = None
    reason: str | None = None
    oom_kills: int | None = None
    memory_limit_bytes: int | None = None

    def report(self) -> dict[str, Any]:
        """The fields this adds to the report's `exit` (contract.py), None ones left out."""
        fields = {"rootCause": self.text, "rank": self.rank, "signal": self.signal,
                  "reason": self.reason, "oomKills": self.oom_kills,
                  "memoryLimitBytes": self.memory_limit_bytes}
        return {key: value for key, value in fields.items() if value is not None}


def error_lines(error: Mapping[str, Any] | None) -> str | None:
    """The error line of a torchelastic error file, then the last FRAMES frames above it."""
    message = (error or {}).get("message")
    if isinstance(message, str):
        return message
    if not isinstance(message, Mapping) or not isinstance(message.get("message"), str):
        return None
    stack = str((message.get("extraInfo") or {}).get("py_callstack") or "")
    lines = [message["message"]]
    for frame in frames(stack):
        lines += frame
    return "\n".join(lines)[:MAX_CHARS]


def frames(callstack: str) -> list[list[str]]:
    """The last FRAMES frames of a formatted traceback (each its `File` line and its code line,
    without the ^^^ markers), and above them the last frame of the user's own code when those
    are all a library's (a gloo timeout raised inside torch)."""
    parsed: list[list[str]] = []
    for line in callstack.splitlines():
        if line.startswith('  File "'):
            parsed.append([line])
        elif line.startswith("    ") and parsed and len(parsed[-1]) == 1 \
                and line.strip(" ^~") != "":
            parsed[-1].append(line)
    kept = parsed[-FRAMES:]
    own = [frame for frame in parsed if not _library(frame[0])]
    if kept and own and all(_library(frame[0]) for frame in kept):
        kept = [own[-1], *kept]
    return kept


def _library(file_line: str) -> bool:
    return any(part in file_line for part in LIBRARY_PATHS)


def _time(failure: Mapping[str, Any]) -> float:
    message = ((failure.get("error") or {}).get("message"))
    extra = message.get("extraInfo") if isinstance(message, Mapping) else None
    precise = (extra or {}).get("time")
    if isinstance(precise, (int, float)):
        return float(precise)
    stamp = failure.get("timestamp")
    return float(stamp) if isinstance(stamp, (int, float)) else float("inf")


def first_failure(failures: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The rank that failed first (the module's docstring)."""
    own = [f for f in failures if f.get("signal") != "SIGTERM"] or list(failures)
    if not own:
        return None
    return min(own, key=lambda f: (_time(f), f.get("rank") if isinstance(f.get("rank"), int)
                                   else 0))


def _mebibytes(limit: int) -> str:
    return f"{limit / 2**20:.0f}Mi"


def out_of_memory(kills: int, limit: int | None, rank: int | None, signal: str | None) -> str:
    who = f"rank {rank}" if rank is not None else "a process of this pod"
    how = f" ({signal})" if signal else ""
    bound = f", memory limit {_mebibytes(limit)} ({limit} bytes)" if limit else ", no memory limit"
    return (f"out of memory: the kernel's OOM killer ended {who}{how}{bound}; "
            f"{kills} OOM kill(s) in this container during the attempt")


def from_launch(record: Mapping[str, Any] | None, *, oom_kills: int = 0,
                memory_limit: int | None = None,
                rendezvous_timeout: str | None = None) -> RootCause | None:
    """The root cause of a failed launch: `record` the launcher's (error_files.launch_record,
    None when it wrote none), `oom_kills` how many OOM kills the container's cgroup counted
    during the launch, `memory_limit` its limit in bytes (None: unlimited or unknown),
    `rendezvous_timeout` the seconds the group had to form (named when it did not)."""
    failure = first_failure((record or {}).get("failures") or [])
    rank = failure.get("rank") if failure else None
    signal = failure.get("signal") if failure else None
    if oom_kills > 0:
        return RootCause(out_of_memory(oom_kills, memory_limit, rank, signal), rank, signal,
                         OOM_KILLED, oom_kills, memory_limit)
    if failure is not None:
        text = error_lines(failure.get("error"))
        if text is None:
            code = failure.get("exitCode")
            text = (f"rank {rank} was killed by {signal}" if signal
                    else f"rank {rank} exited with code {code} and wrote no error")
        elif any(sign in text.partition("\n")[0] for sign in PEER_LOST_SIGNS):
            return RootCause(f"rank {rank} lost a peer (another rank, or its pod, failed first): "
                             f"{text}"[:MAX_CHARS], rank, signal, PEER_LOST)
        return RootCause(text, rank, signal, None, None, None)
    return _launcher_error(record, rendezvous_timeout)


def _launcher_error(record: Mapping[str, Any] | None,
                    timeout: str | None = None) -> RootCause | None:
    """The launcher's own exception: a rendezvous that never formed, above all."""
    names = [str(name) for name in (record or {}).get("exception") or []]
    if not names:
        return None
    reason = next((RENDEZVOUS_ERRORS[name] for name in names if name in RENDEZVOUS_ERRORS), None)
    message = str(record.get("message") or "").strip()  # type: ignore[union-attr]
    text = f"{names[0]}: {message}" if message else names[0]
    if reason is not None:
        within = f" within {timeout}s ({ENV_RENDEZVOUS_TIMEOUT})" if timeout else ""
        text = (f"the rendezvous did not complete{within}: {text}. Every pod of the group must "
                "start and reach pod 0's main port")
    return RootCause(text[:MAX_CHARS], reason=reason)

