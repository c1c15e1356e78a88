"""DeepSpeed's CPU ops (cpu_adam, the shm collectives) built for a baseline CPU, and a check that
no instruction beyond that baseline is in the libraries built.

DeepSpeed compiles its CPU ops for the machine that builds them: `-march=native` and a SIMD
width read from that machine's CPU (op_builder/builder.py, `cpu_arch()` and `simd_width()`; no
setting changes either). An image would carry the build runner's instructions and die with an
illegal instruction on an older or different CPU. `build` runs DeepSpeed's own setup.py with those
two answers fixed to the baseline of the machine's architecture:

    x86_64   -march=x86-64-v2 (SSE4.2, POPCNT: every x86-64 server CPU since 2009), scalar Adam
    aarch64  -march=armv8-a, NEON Adam (NEON is part of armv8-a)

`check` disassembles every compiled library of the wheels (objdump) and fails, naming the
function and the instruction, when one is beyond x86-64-v2 (VEX/EVEX-encoded: AVX, AVX2, FMA,
F16C, AVX-512; ymm/zmm/mask registers; BMI1/2, LZCNT, MOVBE, ADX, AES, SHA, PCLMUL...) or uses
SVE on aarch64. The only exceptions are the functions DeepSpeed compiles for a newer CPU on
purpose and calls only after asking the CPU at run time (RUNTIME_DISPATCHED).

    python deepspeed_ops.py build SDIST_DIR WHEEL_DIR
    python deepspeed_ops.py check WHEEL...
"""

from __future__ import annotations

import os
import platform
import re
import runpy
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BASELINES = {"x86_64": ("-march=x86-64-v2", "-D__SCALAR__"),
             "aarch64": ("-march=armv8-a", "-D__NEON__")}

# shm.cpp's reduce kernels and copy carry __attribute__((target("avx512bw"))); the shm op's
# vector_kernel_level() asks the CPU (__builtin_cpu_supports) and deepspeed/comm/torch.py uses
# them only at the level they need, else torch.distributed's all_reduce.
RUNTIME_DISPATCHED = {"deepspeed_shm_comm_op": ("reduce_bf16_buffers(", "reduce_fp16_buffers(",
                                                "reduce_fp32_buffers(", "parallel_memcpy(")}

_X86_PREFIXES = {"lock", "rep", "repz", "repe", "repnz", "repne", "notrack", "bnd", "data16",
                 "cs", "ds", "es", "fs", "gs", "ss", "addr32", "rex", "rex.w", "rex.b"}
# Not in x86-64-v2 (x86-64 + CMPXCHG16B, LAHF/SAHF, POPCNT, SSE3, SSSE3, SSE4.1, SSE4.2). tzcnt is
# left out: compilers emit it for any target, as `rep bsf`, which older CPUs run as bsf.
_X86_BEYOND = re.compile(
    r"^(v(?!err|erw)\w+|k(mov|and|andn|or|xor|xnor|not|shift\w*|ortest|test|add|unpck)\w*"
    r"|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|movbe"
    r"|adcx|adox|aes\w+|pclmul\w*|sha1\w+|sha256\w+|gf2p8\w+|tile\w+|ldtilecfg|sttilecfg"
    r"|tdp\w+)$")
_X86_REGISTERS = re.compile(r"%(ymm|zmm)\d+|%k[0-7]\b")
_SVE_REGISTERS = re.compile(r"\bz\d+\.[bhsdq]\b|\bp\d+/[mz]\b")
SHOWN = 12  # functions named in the error; the count says how many more
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+(.*)$")


def build(sdist: Path, wheels: Path) -> None:
    """DeepSpeed's setup.py, run from its source with cpu_arch()/simd_width() answering the
    baseline (DS_BUILD_* and DS_ACCELERATOR in the environment pick the ops)."""
    arch, simd = BASELINES[platform.machine()]
    os.chdir(sdist)
    sys.path.insert(0, str(sdist))
    from op_builder import builder  # DeepSpeed's own, from the source tree

    builder.OpBuilder.cpu_arch = lambda self: arch
    builder.OpBuilder.simd_width = lambda self: simd
    sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", str(wheels)]
    runpy.run_path("setup.py", run_name="__main__")


def beyond_baseline(machine: str, instruction: str) -> bool:
    """Whether one disassembled instruction (objdump's text after the address) needs more than
    the baseline CPU of `machine`."""
    if machine == "aarch64":
        return bool(_SVE_REGISTERS.search(instruction))
    words = instruction.split()
    while words and words[0] in _X86_PREFIXES:
        words = words[1:]
    return bool(words) and (bool(_X86_BEYOND.match(words[0]))
                            or bool(_X86_REGISTERS.search(instruction)))


def findings(disassembly: str, machine: str, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """{function: its first instruction beyond the baseline}, from `objdump -d -C` text,
    leaving out the functions whose names start with one of `allowed` (their clones too)."""
    found: dict[str, str] = {}
    function = "?"
    for line in disassembly.splitlines():
        if header := _FUNCTION.match(line):
            function = header.group(1)
        elif (body := _INSTRUCTION.match(line)) and function not in found \
                and not function.startswith(allowed) \
                and beyond_baseline(machine, body.group(1)):
            found[function] = body.group(1).strip()
    return found


def check(wheels: list[Path], machine: str = platform.machine()) -> int:
    problems, libraries = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                for name in (n for n in archive.namelist() if n.endswith(".so")):
                    path = archive.extract(name, tmp)
                    text = subprocess.run(["objdump", "-d", "-C", "-w", "--no-show-raw-insn",
                                           path], capture_output=True, text=True,
                                          check=True).stdout
                    op = Path(name).name.split(".")[0]
                    for function, insn in findings(text, machine,
                                                   RUNTIME_DISPATCHED.get(op, ())).items():
                        problems.append(f"{name}: {function}: {insn}")
                    libraries += 1
    if not libraries:
        sys.stderr.write("deepspeed_ops: no compiled library in the wheels: nothing was built\n")
        return 1
    if problems:
        shown = "".join(f"  {p[:300]}\n" for p in problems[:SHOWN])
        left = len(problems) - SHOWN
        more = f"  ... and {left} more functions\n" if left > 0 else ""
        sys.stderr.write(
            f"deepspeed_ops: {len(problems)} functions with instructions beyond the {machine} "
            f"baseline ({BASELINES[machine][0]}): the image would die with SIGILL on older CPUs. "
            "Build with `deepspeed_ops.py build`, or, for a function DeepSpeed dispatches at run "
            "time, add it to RUNTIME_DISPATCHED:\n" + shown + more)
        return 1
    print(f"deepspeed_ops: {libraries} libraries, nothing beyond {BASELINES[machine][0]}")
    return 0


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "build":
        build(Path(paths[0]).resolve(), Path(paths[1]).resolve())
    else:
        sys.exit(check([Path(p) for p in paths]))
