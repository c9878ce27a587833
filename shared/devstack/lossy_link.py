"""A lossy network path for the fault proxy (shared/devstack/netfault.py): a veth pair into a
private network namespace, and a packet dropper on the veth that loses a set share of the
packets each way while a loss fault is on.

::

    link = LossyLink().open()            # LossPathUnavailableError where it cannot be built
    sock = link.listen_socket()          # a TCP listener *inside* the namespace (the relay's)
    ...                                  # connect to link.relay_address(sock) from the host
    link.set_loss(5.0)                   # 5 % of the packets dropped, each direction
    link.clear()                         # no loss
    link.counters()                      # packets seen and dropped each way (LossCounters)
    link.close()                         # dropper detached, veth deleted, namespace released

Why a real link: a TCP proxy can refuse, reset, hold or delay bytes, but it cannot lose a
packet; TCP hides losses from it. Only packets that cross a network device can be lost, so the
fault proxy's upstream connections cross the veth (host end ``snf<pid>x<n>h``, namespace end
``...n``, a /30 of 10.128.0.0/9 that no address or route of the host overlaps) to a relay
listening in the namespace, which connects back to the real server on the host's loopback (its
sockets for that side are made in the host namespace). The relay runs in the fault proxy's own
asyncio loop: this module gives it a listening socket made in the namespace.

The dropper: ``tc qdisc ... netem loss 5%`` would be the usual tool, but kernels are built
without ``sch_netem`` (the CI machine's: "Specified qdisc kind is unknown";
``CONFIG_NET_SCH_NETEM`` not set) and without ``act_gact``, so the drops are made by a tiny
eBPF program of type ``sched_cls`` attached with tcx (Linux >= 6.6) to the host end of the
veth, on egress (host -> namespace: requests) and on ingress (namespace -> host: answers). For
each packet it draws ``bpf_get_prandom_u32()`` and drops the packet (``TCX_DROP``) when the
draw is below the loss share of 2**32, and counts both outcomes in a 4-slot array map (read by
:meth:`LossyLink.counters`). Both devices have ``gso_max_segs 1``, so a packet is one MTU-sized
segment, not a 64 KiB GSO aggregate.

Cleanup, on every exit: the namespace has no name (``unshare(CLONE_NEWNET)`` in a short-lived
thread); only this process's file descriptors (the namespace's, the listener's and its
connections') hold it, so when the process ends, however it ends (SIGKILL included), the
kernel frees the namespace, which deletes the veth pair, and closes the tcx links, which
detaches the dropper. :meth:`LossyLink.close` does the same at once. Before building a link,
:func:`sweep_stale_links` deletes any ``snf<pid>x...h`` device whose process is gone (the
names carry the creator's pid), in case one outlived its process anyway.

What it needs: Linux, root (CAP_NET_ADMIN, CAP_SYS_ADMIN for the namespace, CAP_BPF), the
``ip`` command (iproute2) and a kernel with tcx. Without any of these, :meth:`LossyLink.open`
raises :class:`LossPathUnavailableError`, whose ``reason`` says which; callers report it and
go on without loss faults.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import platform
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: Prefix of the devices this module makes (host end ``snf<pid>x<n>h``, namespace end ``...n``).
PREFIX = "snf"
_STALE = re.compile(rf"^\d+:\s+({PREFIX}(\d+)x[0-9a-z]+h)(?:@[^:]*)?:")
#: The /30s are drawn from this range (checked against the host's addresses and routes).
SUBNET_POOL = ipaddress.ip_network("10.128.0.0/9")
_counter = itertools.count()

CLONE_NEWNET = 0x40000000
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "armv7l": 386, "ppc64le": 361, "s390x": 351}
# bpf(2) commands, program, map and attach types, helpers (include/uapi/linux/bpf.h).
_BPF_MAP_CREATE, _BPF_MAP_LOOKUP_ELEM, _BPF_PROG_LOAD, _BPF_LINK_CREATE = 0, 1, 5, 28
_BPF_MAP_TYPE_ARRAY = 2
_BPF_PROG_TYPE_SCHED_CLS = 3
_BPF_TCX_INGRESS, _BPF_TCX_EGRESS = 46, 47
_FN_MAP_LOOKUP_ELEM, _FN_GET_PRANDOM_U32 = 1, 7
_TCX_PASS, _TCX_DROP = 0, 2
_ATTR_SIZE = 128  # larger than every bpf_attr member used here; the tail stays zero
#: Counter slots: (egress seen-and-passed, egress dropped, ingress passed, ingress dropped).
_SLOT_EGRESS, _SLOT_INGRESS = 0, 2


class LossyLinkError(RuntimeError):
    """The lossy link could not be built or driven (a command or a system call failed)."""


class LossPathUnavailableError(LossyLinkError):
    """This machine cannot give a lossy path (not Linux, not root, no ``ip``, no network
    namespaces, no tcx eBPF); ``reason`` says which, for a skip or a campaign's log."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"expected a lossy network path (veth in a network namespace, eBPF "
                         f"packet dropper), found it impossible here: {reason}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LossCounters:
    """Packets the dropper saw, each way, since the link was opened (``out``: host ->
    namespace, the requests; ``in``: namespace -> host, the answers)."""

    out_passed: int = 0
    out_dropped: int = 0
    in_passed: int = 0
    in_dropped: int = 0


# -- system calls -------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def _errno_text() -> str:
    e = ctypes.get_errno()
    return f"{os.strerror(e)} (errno {e})"


def _bpf(cmd: int, attr: bytes) -> int:
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        raise LossPathUnavailableError(f"no bpf(2) system call number known for {platform.machine()}")
    buf = ctypes.create_string_buffer(attr.ljust(_ATTR_SIZE, b"\0"), _ATTR_SIZE)
    fd = _c().syscall(ctypes.c_long(nr), ctypes.c_int(cmd), buf, ctypes.c_uint(_ATTR_SIZE))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"bpf({cmd}): {_errno_text()}")
    return int(fd)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _dropper(map_fd: int, threshold: int, slot: int) -> bytes:
    """The program: drop when ``prandom_u32() < threshold``; count the verdict in
    ``map[slot]`` (passed) or ``map[slot + 1]`` (dropped)."""
    imm = threshold - (1 << 32) if threshold >= 1 << 31 else threshold  # a u32 as the s32 field
    return b"".join([
        _insn(0x85, imm=_FN_GET_PRANDOM_U32),          # 0: r0 = bpf_get_prandom_u32()
        _insn(0xB7, dst=6, imm=_TCX_PASS),             # 1: r6 = TCX_PASS
        _insn(0x36, dst=0, off=1, imm=imm),            # 2: if w0 >= threshold goto 4
        _insn(0xB7, dst=6, imm=_TCX_DROP),             # 3: r6 = TCX_DROP
        _insn(0xB7, dst=1, imm=slot),                  # 4: r1 = slot
        _insn(0x15, dst=6, off=1, imm=_TCX_PASS),      # 5: if r6 == TCX_PASS goto 7
        _insn(0x07, dst=1, imm=1),                     # 6: r1 += 1
        _insn(0x63, dst=10, src=1, off=-4),            # 7: *(u32 *)(r10 - 4) = r1
        _insn(0xBF, dst=2, src=10),                    # 8: r2 = r10
        _insn(0x07, dst=2, imm=-4),                    # 9: r2 += -4 (the key)
        _insn(0x18, dst=1, src=1, imm=map_fd),         # 10: r1 = the map (ld_imm64, map fd)
        _insn(0x00),                                   # 11:   (its upper half)
        _insn(0x85, imm=_FN_MAP_LOOKUP_ELEM),          # 12: r0 = &map[key]
        _insn(0x15, dst=0, off=2, imm=0),              # 13: if r0 == NULL goto 16
        _insn(0xB7, dst=1, imm=1),                     # 14: r1 = 1
        _insn(0xDB, dst=0, src=1, imm=0),              # 15: lock *(u64 *)r0 += r1
        _insn(0xBF, dst=0, src=6),                     # 16: r0 = r6 (the verdict)
        _insn(0x95),                                   # 17: exit
    ])


def _prog_load(code: bytes, name: bytes) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(8192)
    attr = struct.pack(
        "<IIQQIIQII16s", _BPF_PROG_TYPE_SCHED_CLS, len(code) // 8, ctypes.addressof(insns),
        ctypes.addressof(lic), 1, len(log), ctypes.addressof(log), 0, 0, name[:15],
    )
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except OSError as e:
        verifier = log.value.decode(errors="replace").strip().splitlines()[-3:]
        raise LossPathUnavailableError(f"the kernel refused the packet dropper: {e} {verifier}") from e


def _map_create(slots: int) -> int:
    try:
        return _bpf(_BPF_MAP_CREATE, struct.pack("<IIIII", _BPF_MAP_TYPE_ARRAY, 4, 8, slots, 0))
    except OSError as e:
        raise LossPathUnavailableError(f"no eBPF maps here (CAP_BPF?): {e}") from e


def _map_read(map_fd: int, slot: int) -> int:
    key = ctypes.c_uint32(slot)
    value = ctypes.c_uint64(0)
    _bpf(_BPF_MAP_LOOKUP_ELEM, struct.pack("<IIQQQ", map_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0))
    return int(value.value)


def _tcx_attach(prog_fd: int, ifindex: int, attach_type: int) -> int:
    try:
        return _bpf(_BPF_LINK_CREATE, struct.pack("<IIII", prog_fd, ifindex, attach_type, 0))
    except OSError as e:
        raise LossPathUnavailableError(f"cannot attach the packet dropper with tcx (Linux >= 6.6): {e}") from e


# -- namespaces and iproute2 --------------------------------------------------------------------


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a new thread and return its result (or raise its exception): a namespace
    change made there stays with that thread, which then ends."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failure.append(e)

    t = threading.Thread(target=run, name="lossy-link-netns", daemon=True)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return result[0]


def _new_netns() -> int:
    """A new network namespace, without a name: the returned descriptor holds it."""

    def make() -> int:
        if _c().unshare(CLONE_NEWNET) != 0:
            raise LossPathUnavailableError(f"cannot create a network namespace (unshare(CLONE_NEWNET)): {_errno_text()}")
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    return _in_thread(make)


def _in_netns(ns_fd: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` inside the namespace ``ns_fd`` (in a thread of its own; a process it starts
    is in the namespace too)."""

    def enter() -> T:
        if _c().setns(ns_fd, CLONE_NEWNET) != 0:
            raise LossyLinkError(f"expected to enter the link's network namespace, found: {_errno_text()}")
        return fn()

    return _in_thread(enter)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise LossyLinkError(f"expected `ip {' '.join(args)}` to succeed, found exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_links() -> list[str]:
    """Delete the host ends (``snf<pid>x<n>h``) of links whose creating process is gone, and
    return their names. (The kernel deletes a link with its namespace when the process ends;
    this catches any that survived. A pid of another pid namespace sharing this network
    namespace would read as gone: the devices are named for one machine's test runs.)"""
    out = _ip("-o", "link", "show", check=False).stdout
    gone = []
    for line in out.splitlines():
        m = _STALE.match(line)
        if m and not _pid_alive(int(m.group(2))):
            if _ip("link", "del", m.group(1), check=False).returncode == 0:
                gone.append(m.group(1))
    return gone


def _host_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    text = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", "table", "all", check=False).stdout
    for word in text.split():
        if word[:1].isdigit() and "." in word:
            try:
                nets.append(ipaddress.IPv4Network(word, strict=False))
            except ValueError:
                continue
    return nets


def _pick_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    taken = _host_networks()
    for _ in range(200):
        base = int(SUBNET_POOL.network_address) + 4 * rng.randrange(SUBNET_POOL.num_addresses // 4)
        net = ipaddress.IPv4Network((base, 30))
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise LossyLinkError(f"expected a free /30 in {SUBNET_POOL}, found every one drawn in use")


def check_prerequisites() -> None:
    """Raise :class:`LossPathUnavailableError` when this machine cannot have a lossy link
    (checked before anything is made)."""
    if not sys.platform.startswith("linux"):
        raise LossPathUnavailableError(f"network namespaces and tcx are Linux's; this is {sys.platform}")
    if os.geteuid() != 0:
        raise LossPathUnavailableError(
            f"needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF) for the namespace, the veth and the "
            f"dropper; running as uid {os.geteuid()}")
    if shutil.which("ip") is None:
        raise LossPathUnavailableError("the `ip` command (iproute2) is not on PATH")
    if platform.machine() not in _SYS_BPF:
        raise LossPathUnavailableError(f"no bpf(2) system call number known for {platform.machine()}")
    release = platform.release()
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None or (int(m.group(1)), int(m.group(2))) < (6, 6):
        raise LossPathUnavailableError(f"the packet dropper attaches with tcx, Linux >= 6.6; this kernel is {release}")


# -- the link -----------------------------------------------------------------------------------


class LossyLink:
    """One veth pair into a private namespace, with a packet dropper on its host end (see the
    module docstring). Not thread-safe: one owner drives it (the fault proxy's commands)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        n = next(_counter)
        tag = f"{os.getpid()}x{_base36(n)}"
        self.host_ifname = f"{PREFIX}{tag}h"
        self.ns_ifname = f"{PREFIX}{tag}n"
        self.host_ip = ""
        self.ns_ip = ""
        self.loss_percent = 0.0
        self._rng = rng or random.Random()
        self._ns_fd: int | None = None
        self._map_fd: int | None = None
        self._links: list[int] = []
        self._progs: list[int] = []

    def open(self) -> LossyLink:
        """Build the namespace, the veth and the dropper's map, and check that tcx takes a
        program (so a machine without it fails here, not at the first fault)."""
        check_prerequisites()
        sweep_stale_links()
        self._ns_fd = _new_netns()
        try:
            net = _pick_subnet(self._rng)
            host_ip, ns_ip = (str(a) for a in list(net.hosts())[:2])
            ns_path = f"/proc/{os.getpid()}/fd/{self._ns_fd}"
            _ip("link", "add", self.host_ifname, "type", "veth", "peer", "name", self.ns_ifname, "netns", ns_path)
            # One MTU-sized packet per skb: a loss is one segment, not a 64 KiB aggregate.
            _ip("link", "set", self.host_ifname, "gso_max_segs", "1", check=False)
            _ip("addr", "add", f"{host_ip}/30", "dev", self.host_ifname)
            _ip("link", "set", self.host_ifname, "up")

            def inside() -> None:
                _ip("link", "set", self.ns_ifname, "gso_max_segs", "1", check=False)
                _ip("addr", "add", f"{ns_ip}/30", "dev", self.ns_ifname)
                _ip("link", "set", self.ns_ifname, "up")
                _ip("link", "set", "lo", "up")

            _in_netns(self._ns_fd, inside)
            self.host_ip, self.ns_ip = host_ip, ns_ip
            self._map_fd = _map_create(4)
            self.set_loss(0.0, probe=True)  # attach and detach once: tcx is there
        except BaseException:
            self.close()
            raise
        return self

    def listen_socket(self) -> socket.socket:
        """A TCP socket listening on ``(ns_ip, port)`` inside the namespace (port from the
        kernel); connections to it from the host cross the veth."""
        if self._ns_fd is None:
            raise LossyLinkError("expected the lossy link open, found it closed")

        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.ns_ip, 0))
            s.listen(512)
            return s

        return _in_netns(self._ns_fd, make)

    def set_loss(self, percent: float, *, probe: bool = False) -> None:
        """Drop ``percent`` % of the packets in each direction from now on (0: none; the
        dropper is detached). ``probe``: attach and detach at once (a check of tcx)."""
        if not 0.0 <= percent <= 100.0:
            raise ValueError(f"expected a loss between 0 and 100 %, found {percent}")
        if self._map_fd is None:
            raise LossyLinkError("expected the lossy link open, found it closed")
        self.clear()
        if percent == 0.0 and not probe:
            return
        threshold = min((1 << 32) - 1, int(percent / 100.0 * (1 << 32)))
        ifindex = socket.if_nametoindex(self.host_ifname)
        try:
            for slot, attach, name in ((_SLOT_EGRESS, _BPF_TCX_EGRESS, b"snf_loss_out"),
                                       (_SLOT_INGRESS, _BPF_TCX_INGRESS, b"snf_loss_in")):
                prog = _prog_load(_dropper(self._map_fd, threshold, slot), name)
                self._progs.append(prog)
                self._links.append(_tcx_attach(prog, ifindex, attach))
        except BaseException:
            self.clear()
            raise
        self.loss_percent = percent
        if probe:
            self.clear()

    def clear(self) -> None:
        """No loss: detach the dropper (closing a tcx link detaches its program)."""
        fds, self._links = self._links + self._progs, []
        self._progs = []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.loss_percent = 0.0

    def counters(self) -> LossCounters:
        if self._map_fd is None:
            return LossCounters()
        return LossCounters(*(_map_read(self._map_fd, i) for i in range(4)))

    def close(self) -> None:
        """Detach the dropper, delete the veth pair and let the namespace go (idempotent)."""
        self.clear()
        if self._map_fd is not None:
            os.close(self._map_fd)
            self._map_fd = None
        if self._ns_fd is not None:
            _ip("link", "del", self.host_ifname, check=False)  # its peer goes with it
            os.close(self._ns_fd)
            self._ns_fd = None

    def __enter__(self) -> LossyLink:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
