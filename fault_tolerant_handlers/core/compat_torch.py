"""Every use of torch's private API, in one place, checked against torch 2.13.0 (``torch>=2.8``).

Each list of private names is looked up before its first use (:func:`check` at the first session,
:func:`check_ddp`; torch's DataLoader's in ``data/compat_dataloader.py``), failing with an error that
names what is missing; looked for where used: ``mp.spawn``'s ``_wrap`` frame (:func:`spawn_error_file`), gloo's epoll loops
(:func:`disarm_loops`) and ``torch.distributed``'s ``__defaults__`` (:func:`forget_destroyed_groups`).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import platform
import sys
import threading
import types
from typing import Any

import torch
import torch.distributed as dist

from .procfs import fd_targets, main_thread_frame

CHECKED_AGAINST = ("2.13.0",)
#: The DDP bucket-layout calls below were read in and checked against these torch versions.
DDP_CHECKED_AGAINST = ("2.13.0",)

_REQUIRED = (
    ("torch.distributed.distributed_c10d", "_get_default_store"),  # the store the default group was made with
    ("torch.distributed.distributed_c10d", "_get_default_group"),  # the default process group (registry key)
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d._world", "pg_map"),  # every process group of this process (release)
    ("torch.distributed.distributed_c10d", "_abort_process_group"),  # abort an NCCL/XCCL group (release)
    ("torch.distributed.Store", "clone"),  # a new connection to the same store (public, 2.8+)
)

_checked = False


def check() -> None:
    """Raise ``RuntimeError`` naming every private torch attribute this version lacks."""
    global _checked
    if _checked:
        return
    c10d = dist.distributed_c10d
    if missing := lacking(_REQUIRED, {"torch.distributed.distributed_c10d": c10d, "torch.distributed.Store": dist.Store,
                                      "torch.distributed.distributed_c10d._world": getattr(c10d, "_world", None)}):
        raise RuntimeError(f"fault-tolerant-handlers needs {', '.join(missing)}, which torch {torch.__version__} does "
                           f"not have (checked against torch {', '.join(CHECKED_AGAINST)}; torch>=2.8 is required)")
    _checked = True


def import_lazy_modules(dcp: bool = True) -> None:
    """Import what torch imports lazily at a process's first DDP or optimizer (``torch._dynamo``, 0.3-0.5
    s) and, with ``dcp``, what a sharded model's shard is loaded through (0.3 s): a spare before it waits;
    a keeper before its first fork (``dcp=False``), so that a replacement starts with what the first
    child imported."""
    with contextlib.suppress(Exception):  # an optimisation: the training imports it itself, or never
        import torch._dynamo  # noqa: F401
        if dcp:
            import torch.distributed.checkpoint  # noqa: F401


def forget_destroyed_groups() -> int:
    """Replace by ``None`` (the current default group) every destroyed process group a
    ``torch.distributed`` function keeps as a default argument (``torch.distributed.nn.functional``'s
    ``group=group.WORLD``, evaluated at import: it would keep the group alive and be used destroyed);
    returns how many functions held one."""
    live = set(process_groups())

    def gone(value: Any) -> bool:
        return issubclass(type(value), dist.ProcessGroup) and value not in live

    # type() only, never an attribute of another object: torch.distributed.reduce_op warns at any
    # attribute read (its __getattribute__ is deprecated), and silencing it with warnings.catch_warnings
    # would swap the process-wide filters for the scan, losing another thread's warning meanwhile
    changed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for obj in list(vars(module).values()):
            for fn in list(vars(obj).values()) if issubclass(type(obj), type) else (obj,):
                if type(fn) in (staticmethod, classmethod):
                    fn = fn.__func__
                defaults = fn.__defaults__ if type(fn) is types.FunctionType else None
                if defaults and any(gone(d) for d in defaults):
                    fn.__defaults__ = tuple(None if gone(d) else d for d in defaults)
                    changed += 1
    return changed


def default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def process_groups() -> list[dist.ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map.keys())


def abort_process_group(group: dist.ProcessGroup) -> None:
    dist.distributed_c10d._abort_process_group(group)


def spawn_error_file() -> str | None:
    """Under ``mp.spawn`` (the main thread inside ``torch.multiprocessing.spawn._wrap``) the path of the
    error file the parent reads (``""``: that frame holds none); ``None`` otherwise."""
    frame, depth, suffix = main_thread_frame(), 0, os.path.join("torch", "multiprocessing", "spawn.py")
    while frame is not None and depth < 256:
        if frame.f_code.co_name == "_wrap" and frame.f_code.co_filename.endswith(suffix):
            path = frame.f_locals.get("error_file")
            return path if isinstance(path, str) else ""
        frame, depth = frame.f_back, depth + 1
    return None


def store_chain(store: dist.Store | None) -> list[dist.Store]:
    """``store`` and every store under its ``PrefixStore`` wrappers, outermost first: the one unwrap."""
    chain: list[dist.Store] = []
    while store is not None and len(chain) < 16:
        chain.append(store)
        store = getattr(store, "underlying_store", None)
    return chain


def tcp_store_of(store: dist.Store | None) -> dist.TCPStore | None:
    """The ``TCPStore`` under ``store``'s ``PrefixStore`` wrappers."""
    return next((s for s in store_chain(store) if isinstance(s, dist.TCPStore)), None)


#: Where a gloo error comes from: its text points into gloo's transport (``.../gloo/transport/tcp/
#: pair.cc:534] Connection closed by peer``) or into torch's gloo process group.
_GLOO_MARKERS = ("gloo/transport/", "ProcessGroupGloo.cpp")


def is_backend_error(exc: BaseException) -> bool:
    """True for what a collective or the store raises when a peer is gone or this rank was released:
    torch's ``DistError`` family, and gloo's plain ``RuntimeError`` whose text points into gloo."""
    if isinstance(exc, dist.DistError):  # (torch 2.8+)
        return True
    return type(exc) is RuntimeError and any(marker in str(exc) for marker in _GLOO_MARKERS)


# -- a DDP model's bucket layout -------------------------------------------------------------------

#: What a DDP model's bucket layout uses (:func:`ddp_bucket_layout`, :func:`use_ddp_bucket_layout`).
_DDP_REQUIRED = (
    # rebuilt_per_bucket_param_indices: the layout the reducer rebuilt after its first iteration
    ("torch.nn.parallel.DistributedDataParallel", "_get_ddp_logging_data"),
    ("torch.nn.parallel.DistributedDataParallel", "_ddp_init_helper"),  # builds the reducer (as __setstate__)
    ("torch.nn.parallel.DistributedDataParallel", "_build_params_for_reducer"),  # in the reducer's order
    ("torch.nn.parallel.DistributedDataParallel", "_build_debug_param_to_name_mapping"),  # names (debug mode)
    ("torch.distributed", "_compute_bucket_assignment_by_size"),  # the layout _ddp_init_helper asks for
    ("torch.distributed", "_register_comm_hook"),  # a registered comm hook, onto the new reducer
    ("torch.distributed.Reducer", "_remove_autograd_hooks"),
    ("torch.distributed.Reducer", "_set_static_graph"),
    ("torch.distributed.Logger", "_set_static_graph"),
)
_DDP_ATTRS = ("reducer", "logger", "static_graph", "_comm_hooks")  # what is replayed onto the new reducer
_DDP_LOCK = threading.Lock()  # one patched _compute_bucket_assignment_by_size at a time


def check_ddp(ddp: Any = None) -> None:
    """Raise ``RuntimeError`` naming every private torch name the bucket layout needs that this torch
    (or ``ddp``, a ``DistributedDataParallel``) lacks."""
    ddp_class, reducer, logger = torch.nn.parallel.DistributedDataParallel, getattr(dist, "Reducer", None), getattr(dist, "Logger", None)
    missing = lacking(_DDP_REQUIRED, {"torch.nn.parallel.DistributedDataParallel": ddp_class, "torch.distributed": dist,
                                      "torch.distributed.Reducer": reducer, "torch.distributed.Logger": logger})
    missing += [f"DistributedDataParallel().{n}" for n in _DDP_ATTRS if ddp is not None and not hasattr(ddp, n)]
    if missing:
        raise RuntimeError(
            f"fault-tolerant-handlers' DDPBucketLayout needs {', '.join(missing)}, which torch {torch.__version__} "
            f"does not have (checked against torch {', '.join(DDP_CHECKED_AGAINST)})")


def ddp_bucket_layout(ddp: Any) -> list[list[int]] | None:
    """The parameter indices of each of ``ddp``'s buckets once its reducer rebuilt them (from the 3rd
    iteration, the 4th with ``static_graph``), else ``None``."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices")
    if not data.get("has_rebuilt_buckets") or not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


def ddp_bucket_sizes(ddp: Any) -> list[int]:
    """The bytes of each bucket of ``ddp``'s reducer when it was built (its logging data)."""
    text = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(s) for s in str(text).split(",") if s.strip()]


def use_ddp_bucket_layout(ddp: Any, layout: list[list[int]]) -> None:
    """Give ``ddp`` a new reducer whose buckets are ``layout``, built as ``__setstate__`` does, with the
    static graph setting and comm hooks carried over (``RuntimeError`` where it cannot)."""
    check_ddp(ddp)
    params, expect_sparse = ddp._build_params_for_reducer()
    flat = sorted(i for bucket in layout for i in bucket)
    if flat != list(range(len(params))):
        raise ValueError(f"a DDP bucket layout of {len(flat)} parameter indices does not fit this model's "
                         f"{len(params)} parameters (a checkpoint of another model?)")
    if getattr(ddp, "_use_python_reducer", False):
        return  # the compiled (Python) reducer reduces parameter by parameter: no buckets
    if any(hasattr(p, "_in_backward_optimizers") for p in params):
        raise RuntimeError("DDPBucketLayout cannot rebuild the reducer of a DDP whose optimizer runs in backward "
                           "(apply_optimizer_in_backward)")
    hooks = list(ddp._comm_hooks)
    registered = ddp._get_ddp_logging_data().get("comm_hook")
    if registered and not hooks:
        raise RuntimeError(f"DDPBucketLayout cannot carry the builtin comm hook {registered!r} over to a new "
                           "reducer: register it after the layout is loaded, or with register_comm_hook")
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in layout]
    calls = []
    original = dist._compute_bucket_assignment_by_size
    me = threading.get_ident()

    def assignment(tensors: Any, *args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        if threading.get_ident() != me or len(tensors) != len(params):
            return original(tensors, *args, **kwargs)
        calls.append(len(tensors))
        # _ddp_init_helper hands the reducer the buckets reversed (its guess at the backward order)
        return [list(b) for b in reversed(layout)], list(reversed(sizes))

    ddp.reducer._remove_autograd_hooks()
    mapping = ddp._build_debug_param_to_name_mapping(params)
    with _DDP_LOCK:
        dist._compute_bucket_assignment_by_size = assignment
        try:
            ddp._ddp_init_helper(params, expect_sparse, mapping, ddp.static_graph)
        finally:
            dist._compute_bucket_assignment_by_size = original
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    if getattr(ddp, "mixed_precision", None) is not None:  # as DistributedDataParallel.__init__ does
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
    for hook, state in hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    if calls != [len(params)] or ddp_bucket_sizes(ddp) != sizes:
        raise RuntimeError(
            f"DDPBucketLayout: torch {torch.__version__}'s DistributedDataParallel._ddp_init_helper did not build "
            f"the reducer with the given buckets (sizes {ddp_bucket_sizes(ddp)}, expected {sizes}; checked against "
            f"torch {', '.join(DDP_CHECKED_AGAINST)})")


# -- the one check of every list of private names ---------------------------------------------------
def lacking(required: tuple, objects: dict) -> list[str]:
    """Each ``(owner, name)`` that ``objects[owner]`` lacks (an owner ``"Class.method"`` not in
    ``objects``: that method's code names it, seen through a ``functools.wraps`` wrapper, such as
    the one Lightning puts on every DataLoader class's ``__init__`` inside ``fit``): the one check
    of every list of private names."""
    missing = []
    for owner, name in required:
        cls, _, method = (owner, "", "") if owner in objects else owner.rpartition(".")
        found = getattr(objects[cls], method, None) if method else None
        code = getattr(inspect.unwrap(found), "__code__", None) if found is not None else None
        if not (code is not None and name in code.co_names if method else hasattr(objects[cls], name)):
            missing.append(f"{owner} ({name})" if method else f"{owner}.{name}")
    return missing


# -- gloo's event loop ----------------------------------------------------------------------------------
_EPOLL_CTL_MOD = 3
_EPOLLONESHOT = 1 << 30


class _EpollEvent(ctypes.Structure):
    """``struct epoll_event``: packed on x86-64 (12 bytes), naturally aligned elsewhere."""
    _pack_ = 1 if platform.machine() in ("x86_64", "AMD64") else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def _epoll_registrations() -> list[tuple[int, int, int, int]]:
    """(epoll fd, registered fd, its inode, registration data) of this process's epoll sets, from
    ``/proc/self/fdinfo`` (``tfd: 7 events: 19 data: 7f3a... pos:0 ino:53d093 sdev:9``)."""
    entries = []
    for fd, target in fd_targets().items():
        if target != "anon_inode:[eventpoll]":
            continue
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[:1] != ["tfd:"] or "data:" not in fields:
                continue
            inode = [field[4:] for field in fields if field.startswith("ino:")]
            with contextlib.suppress(IndexError, ValueError):
                entries.append((fd, int(fields[1]), int(inode[0], 16), int(fields[fields.index("data:") + 1], 16)))
    return entries


def disarm_loops(known: set[int], inodes: dict[int, int]) -> int:
    """In each epoll set where a socket of ``known`` (inodes) is registered, make every socket's
    registration (``inodes``: fd -> inode now) ``EPOLLONESHOT`` with its ``data`` kept; returns how many.
    A destroyed gloo group's loop otherwise spins, level-triggered, on bytes a failed operation left."""
    registrations = [(epfd, tfd, data) for epfd, tfd, inode, data in _epoll_registrations() if inodes.get(tfd) == inode]
    loops = {epfd for epfd, tfd, _ in registrations if inodes[tfd] in known}
    if not loops:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    changed = 0
    for epfd, tfd, data in registrations:
        event = _EpollEvent(_EPOLLONESHOT, data)
        if epfd in loops and libc.epoll_ctl(epfd, _EPOLL_CTL_MOD, tfd, ctypes.byref(event)) == 0:
            changed += 1
    return changed
