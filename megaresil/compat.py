# Over 450 lines long by rule: every private torch API lives in this one module, so a
# torch upgrade is checked in one place (the shims are small and independent).
"""Every use of a private torch API, in one place.

Each function names what it reaches into. Together they were checked on the
torch minor versions CHECKED_TORCH[0] through CHECKED_TORCH[1]:
- 2.13 (the version the project installs): the whole test suite runs on it;
- 2.14: the source of every API used here read in its wheel;
- 2.9, the floor: the first release with every public API megaresil needs
  (DCP's no-collectives save); pyproject.toml's floor is the same version
  (tests/unit/test_compat.py holds the two together).
A torch outside that range is refused when this module is imported, before a
process group or worker exists (MEGARESIL_UNCHECKED_TORCH=1 allows a newer
one). See docs/gpu.md ("PyTorch versions").
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import zipfile
from datetime import timedelta
from typing import Any, BinaryIO, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils import _python_dispatch

# Oldest and newest (major, minor) torch this module was checked against.
CHECKED_TORCH = ((2, 9), (2, 14))
UNCHECKED_TORCH_ENV = "MEGARESIL_UNCHECKED_TORCH"


class UnsupportedTorch(ImportError):
    """The installed torch is outside the versions megaresil was checked on."""


def _minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedTorch(f"cannot read torch version {version!r}; install torch "
                               f"{_name(CHECKED_TORCH[0])} to {_name(CHECKED_TORCH[1])}")
    return int(found.group(1)), int(found.group(2))


def _name(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"


def check_torch_version(version: str, allow_newer: bool = False) -> None:
    """Raise UnsupportedTorch unless `version` (torch.__version__) lies in
    CHECKED_TORCH, or is newer and `allow_newer`."""
    oldest, newest = CHECKED_TORCH
    minor = _minor(version)
    checked = f"megaresil was checked on torch {_name(oldest)} to {_name(newest)}"
    if minor < oldest:
        raise UnsupportedTorch(f"torch {version} is older than {_name(oldest)}: {checked}; "
                               f"upgrade it (pip install 'torch>={_name(oldest)}')")
    if minor > newest and not allow_newer:
        raise UnsupportedTorch(
            f"torch {version} is newer than {checked}; install torch<{newest[0]}.{newest[1] + 1}, "
            f"or set {UNCHECKED_TORCH_ENV}=1 to try it (then run tests/unit/test_compat.py and the "
            "checkpoint tests, and add it to megaresil/compat.py's CHECKED_TORCH)")


check_torch_version(torch.__version__, allow_newer=os.environ.get(UNCHECKED_TORCH_ENV) == "1")


# --- process groups (c10d) ---------------------------------------------------------


def process_groups() -> list[dist.ProcessGroup]:
    """Every live process group of this process (c10d's private registry)."""
    return list(dist.distributed_c10d._world.pg_map)


def set_gloo_timeout(group: dist.ProcessGroup, seconds: float) -> bool:
    """Timeout of the group's gloo collectives started from now on; False
    when the group has no gloo backend (NCCL has its own watchdog and abort).
    An op already blocked keeps the timeout it started with."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    backend._set_default_timeout(timedelta(seconds=seconds))
    return True


def detach_process_group(group: dist.ProcessGroup) -> None:
    """Leave `group` out of the world's teardown: destroy_process_group()
    shuts groups down from c10d's name registry, and a gloo group's shutdown
    waits for an op still blocked in it (an abandoned save thread's), which
    keeps every group shut down after it (the training ones) open until that
    op times out, so peers blocked on them wait too. Detached, the group
    ends when its op times out and its last reference goes."""
    dist.distributed_c10d._world.pg_names.pop(group, None)


def release_failed_backward(device: torch.device) -> None:
    """Make autograd's engine let go of a backward an exception left from
    inside a post-accumulate-grad hook. Torch keeps that backward's graph
    (its nodes, the parameters, and the process groups its custom functions
    hold in their contexts) until the thread runs another backward (checked
    on 2.13): a rank leaving a failed generation so kept its gloo groups'
    connections open, and a peer blocked in one of them waited for its
    timeout (12-42 s) instead of failing at once. A backward of one element
    on the same thread and device releases it (on CUDA the hooks run on
    autograd's device thread: untested on GPU)."""
    with torch.enable_grad():
        torch.ones(1, device=device, requires_grad=True).sum().backward()


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward (a graph task is
    current): there, a forward is activation recomputation's second pass."""
    return torch._C._current_graph_task_id() != -1


def viewed(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor `tensor` is a view of (its `_base`), or itself."""
    return tensor if tensor._base is None else tensor._base


def abort_process_groups() -> None:
    """Abort every process group's communicators (NCCL frees blocked
    collectives this way; gloo ignores it: docs/architecture.md ("A collective
    blocked in gloo cannot be freed"))."""
    dist.distributed_c10d._abort_process_group()


# gloo reports a lost peer as a plain RuntimeError; its transport's message is
# the only sign (checked on 2.13). NCCL and the c10d store raise typed errors.
_GLOO_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "connectFullMesh failed")


def lost_peer_message(text: str) -> bool:
    """Whether an error's text is gloo's report of a lost peer."""
    return any(m in text for m in _GLOO_LOST_PEER)


def lost_peer_error(err: Optional[BaseException]) -> bool:
    """Whether a collective failed because a peer process is gone, also when
    the failure arrives wrapped (torch.distributed.pipelining re-raises a
    stage's error as its own RuntimeError, chained to the original)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistNetworkError) or (
                type(err) is RuntimeError and lost_peer_message(str(err))):
            return True
        err = err.__cause__ or err.__context__
    return False


def collective_counts(exclude: set) -> dict[str, int]:
    """Collectives issued so far on each process group of this process, by
    group name (the same on every member). A group numbers its collectives
    in the same order on all members, so a member with a lower count has not
    yet joined a collective its peers started. Groups in `exclude` are left out."""
    counts: dict[str, int] = {}
    for group in process_groups():
        if group in exclude:
            continue
        try:
            # Private, and absent from torch's stub.
            count = group._get_sequence_number_for_group()  # type: ignore[attr-defined]
            counts[group.group_name] = count
        except RuntimeError:  # a backend that does not number its collectives
            pass
    return counts


def has_nccl_groups() -> bool:
    """Whether any live process group runs collectives through NCCL."""
    return any("nccl" in dist.get_backend(group) for group in process_groups())


# --- TorchElastic's store servers ---------------------------------------------------


def _listening_socket_fd(address: str, port: int) -> tuple[int, int]:
    """(fd, port) of a TCP socket listening on `address` only (port 0: a
    free one); the TCPStore handed the fd owns it from then on."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        server = socket.create_server((address, port), family=family)
    except OSError as err:  # what TCPStore raises, so TorchElastic's own handling applies
        raise RuntimeError(f"cannot listen on {address}:{port}: {err}") from err
    port = server.getsockname()[1]
    return server.detach(), port


def tcp_store_listening_on(address: str) -> Callable[..., dist.TCPStore]:
    """dist.TCPStore, but a server listens on `address` only: a TCPStore
    server binds every interface whatever its host_name says (torch 2.13:
    '::') unless handed a listening socket (master_listen_fd)."""
    def tcp_store(host_name: str, port: int, *args: Any, is_master: bool = False,
                  **kwargs: Any) -> dist.TCPStore:
        if is_master:
            kwargs["master_listen_fd"], port = _listening_socket_fd(address, port)
        # mypy cannot tell that `args` ends before is_master: its callers name it.
        return dist.TCPStore(host_name, port, *args,  # type: ignore[misc]
                             is_master=is_master, **kwargs)
    return tcp_store


@contextlib.contextmanager
def elastic_stores_listening_on(address: Optional[str]) -> Iterator[None]:
    """While an elastic launch runs in this process, TorchElastic's two store
    servers (the c10d rendezvous store, when this agent hosts it, and the
    store the agent shares with its workers) listen on `address` only; None
    leaves torch's every-interface bind. Reaches into
    c10d_rendezvous_backend's module name `TCPStore` (what its private
    _create_tcp_store calls) and DynamicRendezvousHandler's private
    _create_tcp_store_server."""
    if address is None:
        yield
        return
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    tcp_store = tcp_store_listening_on(address)

    def agent_store_server(_handler: Any, master_addr: str, master_port: int) -> dist.TCPStore:
        return tcp_store(master_addr, master_port, is_master=True, multi_tenant=True)

    # Patching torch's private names: mypy holds a class and a method fixed.
    handler_class = DynamicRendezvousHandler
    saved = (c10d_rendezvous_backend.TCPStore, handler_class._create_tcp_store_server)
    c10d_rendezvous_backend.TCPStore = tcp_store  # type: ignore[misc, assignment]
    handler_class._create_tcp_store_server = agent_store_server  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        c10d_rendezvous_backend.TCPStore = saved[0]  # type: ignore[misc]
        handler_class._create_tcp_store_server = saved[1]  # type: ignore[method-assign]


@contextlib.contextmanager
def workers_store_per_round() -> Iterator[None]:
    """While an elastic launch runs in this process, each rendezvous round
    sets up its workers' store anew, hosted by that round's rank 0.
    DynamicRendezvousHandler keeps a node's first round's (its private
    _bootstrap_store_info and _shared_tcp_store_server) and publishes the
    store's address only in a node's first round, so a node new to a later
    round (a hot spare, a node that returns) waited for an address its rank
    0 never published (torch 2.13: 60 s, then DistStoreError), and a
    survivor kept the address of a lost rank 0's store."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(handler: Any) -> Any:
        handler._bootstrap_store_info = None
        handler._shared_tcp_store_server = None
        return original(handler)

    # Patching a method of torch's: mypy holds methods fixed.
    handler_class = DynamicRendezvousHandler
    handler_class.next_rendezvous = next_rendezvous  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        handler_class.next_rendezvous = original  # type: ignore[method-assign]


@contextlib.contextmanager
def rendezvous_method_names_from_frames() -> Iterator[None]:
    """While an elastic launch runs in this process, the rendezvous handler
    names the method behind each of its records from the caller's frame.
    dynamic_rendezvous's get_method_name(depth) calls inspect.stack() twice
    per record, which reads the source lines of every frame on the stack:
    ~0.18 s of CPU a record 30 frames deep, in the nine or so records of a
    round's rendezvous and of the launch's shutdown, both on the path
    between the command and its workers (measured: 1.6 s of CPU for nine).
    Reaches into that module's name `get_method_name`, which its records
    read at call time; left as it is where a torch has no such name."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    saved = getattr(dynamic_rendezvous, "get_method_name", None)
    if saved is None:
        yield
        return

    def get_method_name(depth: int = 2) -> str:
        try:  # frame 0 is this function's, as inspect.stack()[0] is
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack shallower than depth, as the original says
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = saved


@contextlib.contextmanager
def elastic_agent_class(factory: Callable[..., Any]) -> Iterator[None]:
    """While an elastic launch runs in this process, `elastic_launch` builds
    its agent with `factory` (called as LocalElasticAgent is) instead of
    LocalElasticAgent: torch.distributed.launcher.api's launch_agent names
    that class and offers no parameter for another."""
    from torch.distributed.launcher import api

    # Patching the name launch_agent reads: mypy holds a class fixed.
    saved = api.LocalElasticAgent
    api.LocalElasticAgent = factory  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        api.LocalElasticAgent = saved  # type: ignore[misc]


def context_process(context: Any, index: int) -> Any:
    """The subprocess.Popen of process `index` of a SubprocessContext (the
    context TorchElastic starts binaries in): its `subprocess_handlers`."""
    return context.subprocess_handlers[index].proc


def rendezvous_round(handler: Any) -> Optional[tuple[int, int]]:
    """(the round, how many nodes take part in it) of a TorchElastic
    DynamicRendezvousHandler (c10d, etcd-v2) as last synced: its
    `_state_holder.state`; None for another handler (the legacy etcd one
    keeps no such state)."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None:
        return None
    state = holder.state
    return state.round, len(state.participants)


# --- tensor ops ------------------------------------------------------------------


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in `dtype`, in one fused call (what
    clip_grad_norm_ uses inside)."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d `scale`, in one fused call."""
    torch._foreach_mul_(tensors, scale)


def make_wrapper_subclass(cls: type, shape: torch.Size, dtype: torch.dtype,
                          device: str) -> torch.Tensor:
    """A tensor of subclass `cls` with this metadata and no storage (the
    constructor of `__torch_dispatch__` subclasses)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device(device))


def tree_map_only(kind: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with every leaf of type `kind` replaced by fn(leaf) (torch's pytree)."""
    from torch.utils._pytree import tree_map_only as torch_tree_map_only

    return torch_tree_map_only(kind, fn, tree)


# The base class of Python dispatch modes: a mode sees every aten op, below
# autograd, with its outputs. A class, not a function's result, so that
# subclasses type-check; `import torch` imports its module anyway.
TorchDispatchMode = _python_dispatch.TorchDispatchMode


def is_grouped_mm(func: Any) -> bool:
    """Whether a function mode's `func` is the op `F.grouped_mm` calls
    (torch._grouped_mm): a mode sees that op, not the public function."""
    return func is torch._grouped_mm


def storage_identity(storage: torch.UntypedStorage) -> int:
    """A number naming `storage` while it lives: the address of its C++
    storage object (`_cdata`). Unlike `data_ptr()` it tells apart storages
    with no memory (every meta storage's data pointer is 0), and unlike
    `id()` of the Python wrapper it is the same for every wrapper of one
    storage."""
    return storage._cdata


# --- torch.save's files and DCP's storage records -------------------------------------


@contextlib.contextmanager
def torch_save_options(*, crc32: bool, alignment: Optional[int] = None) -> Iterator[None]:
    """torch.save without (or with) the zip records' CRC-32, and with its
    tensor data records starting at multiples of `alignment` bytes
    (torch.utils.serialization.config, patched for this thread's saves)."""
    import torch.utils.serialization.config as serialization_config

    # `patch` is what torch's config modules get at import (install_config_module):
    # absent from the stub.
    with contextlib.ExitStack() as stack:
        stack.enter_context(serialization_config.patch(  # type: ignore[attr-defined]
            "save.compute_crc32", crc32))
        if alignment is not None:
            stack.enter_context(serialization_config.patch(  # type: ignore[attr-defined]
                "save.storage_alignment", alignment))
        yield


# A zip local file header: signature, 22 bytes we skip, name and extra-field lengths.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


def torch_save_data_record(file: BinaryIO) -> Optional[tuple[int, int]]:
    """Offset and size of the tensor data in a torch.save zip of one tensor:
    torch names its storages `<archive>/data/<key>` and stores them
    uncompressed. None unless there is exactly one such record."""
    with zipfile.ZipFile(file) as archive:
        records = [info for info in archive.infolist()
                   if info.filename.split("/")[-2:-1] == ["data"]]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    file.seek(records[0].header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
    if signature != _LOCAL_SIGNATURE:
        return None
    return records[0].header_offset + _LOCAL_HEADER.size + name_length + extra_length, \
        records[0].file_size


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where a chunk lies in its files (filesystem._StorageInfo),
    which its FileSystemReader and `.metadata` expect."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dcp_metadata_private_globals() -> list[tuple[str, str, Any]]:
    """Module, name and value of each private global DCP's pickled metadata
    names: the per-entry storage record (filesystem._StorageInfo), the
    memory-format code of TensorProperties (metadata._MEM_FORMAT_ENCODING),
    and the function that rebuilds a tensor layout by name
    (serialization._get_layout)."""
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return [("torch.distributed.checkpoint.filesystem", "_StorageInfo", _StorageInfo),
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING",
             metadata._MEM_FORMAT_ENCODING),
            ("torch.serialization", "_get_layout", torch.serialization._get_layout)]


def spin_cuda_kernel(cycles: int) -> None:
    """Queue a kernel that spins for `cycles` GPU clock cycles on the current
    CUDA device (torch.cuda._sleep, torch's own test helper)."""
    torch.cuda._sleep(cycles)


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash-attention kernel (what SDPA runs on the CPU) with
    the rows' logsumexp (B, H, L), which the public SDPA does not return:
    aten._scaled_dot_product_flash_attention_for_cpu."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)
    return out, lse


def cpu_flash_attention_grads(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                              causal: bool, scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """That kernel's backward from the rows' output and logsumexp (which may
    be merged over more keys than k, v hold: the grads are then this
    block's share): aten._scaled_dot_product_flash_attention_for_cpu_backward."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv
