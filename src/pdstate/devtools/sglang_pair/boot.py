"""Make the real SGLang code (0.5.19 or 0.5.23) importable on a CPU-only host, in a *child* process.

``install()`` changes process-wide state (``sys.meta_path``, ``sys.modules["sglang"]``,
``torch.compile``), so only child processes call it (importing ``booted`` does, first thing),
never a test or CLI process; importing this module itself changes nothing:

- the cached environment (``PDSTATE_SGLANG_ENV``) is appended to ``sys.path``, after the venv, so
  the venv's torch and numpy always win over anything in it;
- a meta-path finder serves a permissive dummy module for GPU-only packages, but only when the
  real package cannot be found (``importlib.util.find_spec`` of the top-level name);
- ``sglang`` is registered as a bare package with the real ``__path__``: its ``__init__`` (the
  whole frontend) is skipped, every ``sglang.srt.*`` submodule is the real file;
- ``torch.compile`` becomes an identity decorator (it breaks on CPU with a dummy triton present).

``release()`` is the version of the SGLang this process imported (the ``sglang-*.dist-info`` next
to the package it loaded, else ``sglang.version``), and ``row()`` its row of
``integrations.sglang.releases`` (a post-release follows its release): every helper here, and the
driver's children, follow that row's traits (``keyword_api``: 0.5.23's internals). ``server_args`` builds and
``publish`` publishes the ``ServerArgs`` a pool reads at construction; ``unified_kv`` selects
upstream's unified-KV mode for the pools built inside it; ``parallel_context`` gives a rank the
single-rank parallel context the managers read, without torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types

# Top-level packages SGLang imports at module level but never runs on the paths under test.
GPU_ONLY = frozenset(
    {
        "triton",
        "sgl_kernel",
        "sglang_kernel",
        "flashinfer",
        "deep_gemm",
        "deep_ep",
        "flash_mla",
        "tilelang",
        "cuda",
        "cutlass",
        "quack",
        "tvm_ffi",
        "aiter",
        "vllm",
        "torch_memory_saver",
        "torchvision",
        "flash_attn",
        # Not GPU-only, but outside the CPU environment: disaggregation.decode imports it at
        # module level and the paths under test never call it.
        "einops",
    }
)


class _AnyMeta(type):
    """Metaclass of the stand-ins: any attribute is another stand-in class, and calling one with a
    single callable returns it unchanged (``@triton.jit``, ``@triton.autotune(...)``)."""

    def __getattr__(cls, attr: str):
        return _child(cls, cls.__qualname__, attr)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls) -> bool:
        return False


def _child(owner, name: str, attr: str) -> type:
    """``owner.attr``: a new stand-in, kept on ``owner`` (dunder names stay missing)."""
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    child = _stand_in(f"{name}.{attr}")
    setattr(owner, attr, child)
    return child


def _stand_in(name: str) -> type:
    """A class (so ``isinstance`` probes and subclassing work) that stands for anything."""
    return _AnyMeta(name, (), {})


class _Anything(types.ModuleType):
    """A stand-in module: every attribute is a stand-in class; a real version string, so version
    probes (transformers') parse."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__version__ = "0.0.0"

    def __getattr__(self, attr: str):
        return _child(self, self.__name__, attr)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``_Anything`` for a GPU-only package (and its submodules) that is not installed."""

    def __init__(self) -> None:
        self._absent: dict[str, bool] = {}

    def _stubbed(self, top: str) -> bool:
        if top not in GPU_ONLY:
            return False
        if top not in self._absent:
            sys.meta_path.remove(self)
            try:
                self._absent[top] = importlib.util.find_spec(top) is None
            except (ImportError, ValueError):
                self._absent[top] = True
            finally:
                sys.meta_path.insert(0, self)
        return self._absent[top]

    def find_spec(self, fullname, path=None, target=None):
        if self._stubbed(fullname.partition(".")[0]):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Anything(spec.name)

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """The cached environment on ``sys.path``, the stubs, ``torch.compile`` and the bare package (idempotent)."""
    env_dir = os.environ.get("PDSTATE_SGLANG_ENV", "")
    if env_dir and env_dir not in sys.path:
        sys.path.append(env_dir)
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    import torch

    torch.compile = lambda fn=None, *a, **kw: fn if fn is not None else (lambda f: f)
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"sglang is not in the environment {env_dir!r}")
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__ = spec.origin
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg


def server_args(*, speculative: bool, draft_tokens: int = 4, page_size: int = 256, **extra):
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path="dummy", page_size=page_size)
    if speculative:
        kw.update(
            speculative_algorithm="EAGLE",
            speculative_num_draft_tokens=draft_tokens,
            speculative_num_steps=max(1, draft_tokens - 1),
            speculative_eagle_topk=1,
        )
    kw.update(extra)
    return ServerArgs(**kw)


def publish(args) -> None:
    from sglang.srt.runtime_context import get_context

    get_context().set_server_args(args)


@contextlib.contextmanager
def unified_kv(enabled: bool):
    """Pools built inside take upstream's unified-KV layout (its ROCm+env gate, replaced)."""
    env_gate = unified_gate_module()
    saved = env_gate.is_unified_kv_triton
    env_gate.is_unified_kv_triton = lambda: enabled
    try:
        yield
    finally:
        env_gate.is_unified_kv_triton = saved


@functools.cache
def release() -> str:
    """The version of the imported SGLang (``"0.5.23"``): the distribution installed beside the
    package this process loaded (so another sglang elsewhere on the path cannot answer), else the
    package's own ``sglang.version``."""
    import sglang

    for location in getattr(sglang, "__path__", []):
        parent = os.path.dirname(os.path.abspath(location))
        for dist in importlib.metadata.distributions(path=[parent]):
            if (dist.metadata["Name"] or "").lower() == "sglang":
                return dist.version
    from sglang.version import __version__

    return str(__version__)


def row():
    """The imported SGLang's row of ``integrations.sglang.releases``: its own, else the newest
    release not newer than it."""
    from pdstate.integrations.sglang import releases

    return releases.nearest(release())


def unified_gate_module():
    """The module whose ``is_unified_kv_triton`` the DSV4 pool reads at construction."""
    if row().keyword_api:
        return importlib.import_module("sglang.srt.layers.attention.dsv4.unified_kv_gate")
    return importlib.import_module("sglang.kernels.ops.attention.dsv4.unified_kv_kernels.env_gate")


_HELD: list = []  # parallel-context scopes entered for the process's life (0.5.19)


def parallel_context(**values) -> None:
    """tp = cp = dp = pp = 1 (``values`` on top) for this process, without torch.distributed.

    ``keyword_api`` (0.5.23) keeps them with ``override_permanently``; 0.5.19 with an ``override``
    scope held open for the process's life, plus the dp-attention globals and a stand-in PP group its
    managers read.
    """
    from sglang.srt.runtime_context import get_parallel

    ones = dict(tp_size=1, pp_size=1, attn_tp_size=1, attn_cp_size=1, attn_dcp_size=1, attn_dp_size=1)
    zeros = dict(tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0)
    fields = {**ones, **zeros, **values}
    if row().keyword_api:  # the PP group the prefill manager keeps (used for pp > 1 only)
        fields.setdefault("pp_group", single_group())
        get_parallel().override_permanently(**fields)
        return

    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    scope = get_parallel().override(world_size=1, world_rank=0, dcp_size=1, dcp_rank=0, dcp_enabled=False, **fields)
    scope.__enter__()
    _HELD.append(scope)  # never left: a collected scope would restore on exit
    dp_attention._ATTN_DP_RANK, dp_attention._ATTN_DP_SIZE = 0, 1
    if parallel_state._PP is None:
        parallel_state._PP = single_group()


def single_group():
    """A stand-in process group of one rank (what the managers read of a group)."""
    from types import SimpleNamespace

    return SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)


def metadata_buffers(size: int, hidden_size: int, dtype):
    """SGLang's ``MetadataBuffers`` (``keyword_api``, 0.5.23: it requires ``max_sampling_mask_tokens``)."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    if row().keyword_api:
        return MetadataBuffers(size, hidden_size, dtype, max_sampling_mask_tokens=0)
    return MetadataBuffers(size, hidden_size, dtype)


def state_type(name: str):
    """A ``StateType`` member by its 0.5.19 name (``C128_STATE`` is ``DSV4_REQUEST_STATE`` in 0.5.23)."""
    from sglang.srt.disaggregation.base.conn import StateType

    if name == "C128_STATE" and not hasattr(StateType, name):
        return StateType.DSV4_REQUEST_STATE
    return getattr(StateType, name)
