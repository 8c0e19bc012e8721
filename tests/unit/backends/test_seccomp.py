"""The seccomp filter: real libseccomp (loaded through ctypes); nothing spawned or installed."""

from __future__ import annotations

import stat

import pyseccomp

from cc_server.backends.seccomp import (
    DENIED_SYSCALLS,
    MODE_ARGUMENT,
    NAMESPACE_FLAGS,
    SET_ID_BITS,
    filter_bpf,
)

BPF_INSTRUCTION_BYTES = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k


def test_filter_is_nonempty_whole_bpf_instructions() -> None:
    bpf = filter_bpf()
    assert isinstance(bpf, bytes)
    assert len(bpf) > 0
    assert len(bpf) % BPF_INSTRUCTION_BYTES == 0, len(bpf)


def test_filter_built_once_per_process() -> None:
    assert filter_bpf() is filter_bpf()


def test_denied_syscalls_resolve_on_the_native_arch() -> None:
    arch = pyseccomp.system_arch()
    numbers = {name: pyseccomp.resolve_syscall(arch, name) for name, _ in DENIED_SYSCALLS}
    # A negative number is libseccomp's "unknown" (-1) or a pseudo-syscall: not on this arch,
    # so a rule for it would refuse nothing.
    assert {name: n for name, n in numbers.items() if n < 0} == {}


def test_denied_syscalls_unique_with_reasons() -> None:
    names = [name for name, _ in DENIED_SYSCALLS]
    assert len(names) == len(set(names))
    assert all(reason.strip() for _, reason in DENIED_SYSCALLS)


def test_namespace_flags_are_distinct_single_bits() -> None:
    assert len(set(NAMESPACE_FLAGS)) == len(NAMESPACE_FLAGS)
    assert all(flag > 0 and flag & (flag - 1) == 0 for flag in NAMESPACE_FLAGS)


def test_mode_calls_resolve_on_the_native_arch() -> None:
    arch = pyseccomp.system_arch()
    numbers = {
        call: call if isinstance(call, int) else pyseccomp.resolve_syscall(arch, call)
        for call, _ in MODE_ARGUMENT
    }
    assert {call: n for call, n in numbers.items() if n < 0} == {}
    assert len(set(numbers.values())) == len(MODE_ARGUMENT)


def test_set_id_bits_are_the_kernel_s() -> None:
    assert SET_ID_BITS == (stat.S_ISUID, stat.S_ISGID)
