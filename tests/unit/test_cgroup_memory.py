"""cgroup_memory.py over the files as the kernel writes them (v2 memory.events / memory.max, v1
memory.oom_control / memory.limit_in_bytes), laid out as a container sees its cgroup."""

from __future__ import annotations

from accelerate_trainer import cgroup_memory

V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"


def test_cgroup_v2_counts_oom_kills_and_reads_the_limit(tmp_path):
    (tmp_path / "memory.events").write_text(V2_EVENTS)
    (tmp_path / "memory.max").write_text("314572800\n")
    assert cgroup_memory.read(str(tmp_path)) == cgroup_memory.MemoryState(1, 314572800)
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory.read(str(tmp_path)) == cgroup_memory.MemoryState(1, None)


def test_cgroup_v1_counts_oom_kills_and_reads_the_limit(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text(V1_OOM_CONTROL)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory.read(str(tmp_path)) == cgroup_memory.MemoryState(3, None)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("536870912\n")
    assert cgroup_memory.read(str(tmp_path)).limit == 536870912


def test_no_memory_controller_is_unknown_and_counts_no_kill(tmp_path):
    assert cgroup_memory.read(str(tmp_path)) is None
    assert cgroup_memory.kills_between(None, cgroup_memory.MemoryState(4, None)) == 0


def test_kills_between_two_reads(tmp_path):
    (tmp_path / "memory.events").write_text(V2_EVENTS)
    before = cgroup_memory.read(str(tmp_path))
    (tmp_path / "memory.events").write_text(V2_EVENTS.replace("oom_kill 1", "oom_kill 3"))
    assert cgroup_memory.kills_between(before, cgroup_memory.read(str(tmp_path))) == 2

