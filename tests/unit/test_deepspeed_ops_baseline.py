"""images/trainer/deepspeed_ops.py's check, over objdump text as objdump prints it: an
instruction beyond the baseline CPU (x86-64-v2; SVE on aarch64) is found and named with its
function, except in the functions DeepSpeed dispatches at run time; what every x86-64-v2 CPU
runs is not. The image build runs the check on the libraries it compiled (images/trainer/
Dockerfile, stage deepspeed-cpu-ops) and fails on a finding."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("deepspeed_ops",
                                               ROOT / "images" / "trainer" / "deepspeed_ops.py")
deepspeed_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deepspeed_ops)

DISASSEMBLY = """
cpu_adam_op.so:     file format elf64-x86-64

Disassembly of section .text:

000000000000b100 <Adam_Optimizer::Step_1(float*, float*, float*, float*, unsigned long)>:
    b100:\tendbr64
    b104:\tmovaps %xmm1,%xmm0
    b108:\tlock cmpxchg16b (%rdi)
    b10c:\tpopcnt %rax,%rax
    b110:\ttzcnt %rax,%rax
    b114:\tnotrack jmp *%rax
    b118:\tpshufb %xmm1,%xmm2
    b11c:\tcs nopw 0x0(%rax,%rax,1)

000000000000c000 <reduce_bf16_buffers(int, int, char*, char**) [clone ._omp_fn.0]>:
    c000:\tvpbroadcastd %eax,%zmm4
"""


@pytest.mark.parametrize("instruction", [
    "vfmadd231ps %ymm1,%ymm2,%ymm3", "vaddps %xmm1,%xmm2,%xmm3", "vcvtph2ps (%rdi),%zmm0",
    "kmovw %k1,%eax", "vmovups %zmm0,(%rdi){%k1}", "andn %rax,%rbx,%rcx", "shlx %rax,%rbx,%rcx",
    "lzcnt %rax,%rax", "movbe (%rdi),%eax", "aesenc %xmm1,%xmm2", "pclmulqdq $0x0,%xmm1,%xmm2",
    "rep vmovdqu (%rsi),%ymm0",
])
def test_an_instruction_beyond_x86_64_v2_is_found_in_its_function(instruction):
    text = DISASSEMBLY.replace("pshufb %xmm1,%xmm2", instruction)
    assert deepspeed_ops.findings(text, "x86_64", ("reduce_bf16_buffers(",)) == {
        "Adam_Optimizer::Step_1(float*, float*, float*, float*, unsigned long)": instruction}


def test_what_every_x86_64_v2_cpu_runs_and_the_runtime_dispatched_kernels_pass():
    assert deepspeed_ops.findings(DISASSEMBLY, "x86_64", ("reduce_bf16_buffers(",)) == {}


def test_a_runtime_dispatched_kernel_is_found_where_it_is_not_allowed():
    found = deepspeed_ops.findings(DISASSEMBLY, "x86_64")
    assert found == {"reduce_bf16_buffers(int, int, char*, char**) [clone ._omp_fn.0]":
                     "vpbroadcastd %eax,%zmm4"}


@pytest.mark.parametrize(("instruction", "beyond"), [
    ("fmla v0.4s, v1.4s, v2.4s", False), ("ld1w {z0.s}, p0/z, [x0]", True),
    ("fadd z0.s, p0/m, z0.s, z1.s", True), ("ldr q0, [x0]", False),
])
def test_on_aarch64_sve_is_beyond_armv8_a_and_neon_is_not(instruction, beyond):
    assert deepspeed_ops.beyond_baseline("aarch64", instruction) is beyond
