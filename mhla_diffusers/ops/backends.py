"""The registry of :func:`~mhla_diffusers.ops.mhla_attention` backends, by name.

A backend is a :class:`Backend` object: it says whether it is installed, on which devices it runs,
whether ``"auto"`` picks it, whether it applies a rotary itself, and computes the attention. The
eager dispatch (``ops/__init__.py``), the ``torch.compile`` operator (``ops/compiled.py``) and
checkpoint loading all go through this registry. ``"torch"`` (:class:`TorchBackend`: every device,
the default) is registered here; the GPU kernels register themselves in their own module, imported
by ``mhla_diffusers.ops``. A new backend: subclass :class:`Backend`, then :func:`register_backend`.

``forward`` takes ``(q, k, v, mixing, layout, *, normalize, eps, feature_map[, rotary])`` with inputs
already validated by ``mhla_attention`` (``feature_map`` a bool: apply ReLU) and returns
``[B, heads, N, dv]`` in ``q``'s dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping

import torch

from mhla_diffusers.ops.torch_ops import mhla_attention_torch

__all__ = [
    "Backend", "TorchBackend", "DEFAULT_BACKEND", "register_backend", "unregister_backend", "get_backend",
    "registered_backends", "available_backends", "resolve_backend",
]

DEFAULT_BACKEND = "torch"


class Backend:
    """One MHLA backend (module docstring). Subclasses set :attr:`name` and define :meth:`forward`;
    the other methods default to a backend that runs on every device once installed.

    Attributes:
        name: the ``backend=`` string it is registered under.
        fuses_rotary_tables: whether :meth:`forward` may be given ``rotary=`` (an
            :class:`~mhla_diffusers.ops.InterleavedRotary`) when :meth:`fuses_rotary` says so.
    """

    name: str = ""
    fuses_rotary_tables: bool = False

    def is_available(self) -> bool:
        """Whether it is installed at all (it is then listed by :func:`available_backends`)."""
        return True

    def unsupported_reason(self, device: torch.device) -> str | None:
        """Why it cannot run on tensors on ``device`` (a sentence), or ``None`` when it can."""
        return None if self.is_available() else "it is not available in this environment"

    def can_run(self, device: torch.device | str) -> bool:
        """Whether it runs on tensors on ``device`` (:meth:`unsupported_reason` is ``None``)."""
        return self.unsupported_reason(torch.device(device)) is None

    def preferred_for_auto(self, device: torch.device) -> bool:
        """Whether ``backend="auto"`` picks it for tensors on ``device`` (default: never)."""
        return False

    def fuses_rotary(self, rotary, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`forward` applies ``rotary`` itself for these inputs (else ``mhla_attention``
        composes it around two plain calls). Only asked of backends with :attr:`fuses_rotary_tables`."""
        return False

    def kept_on_load(self) -> bool:
        """Whether a checkpoint that records this (available) backend keeps it when loaded on this
        machine; ``False`` loads it with ``"auto"``. Cheap: must not probe drivers."""
        return True

    def forward(self, q, k, v, mixing, layout, *, normalize: bool, eps: float, feature_map: bool, rotary=None) -> torch.Tensor:
        """MHLA of validated inputs (module docstring); differentiable in q, k, v and ``mixing``."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class TorchBackend(Backend):
    """Plain PyTorch (``ops/torch_ops.py``): any device and float dtype; the default and ``"auto"``'s fallback."""

    name = DEFAULT_BACKEND

    def forward(self, q, k, v, mixing, layout, **kwargs) -> torch.Tensor:
        return mhla_attention_torch(q, k, v, mixing, layout, **kwargs)


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry under ``backend.name`` (and return it).

    Raises:
        TypeError: ``backend`` is not a :class:`Backend`.
        ValueError: its name is not a non-empty string, is ``"auto"``, or is taken (unless ``replace``).
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a mhla_diffusers.ops.backends.Backend; got {type(backend).__name__}")
    name = backend.name
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend needs a name other than 'auto' and ''; got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"an MHLA backend named {name!r} is registered already ({_REGISTRY[name]!r}); pass replace=True")
    _REGISTRY[name] = backend
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove the backend registered as ``name`` and return it.

    Raises:
        ValueError: ``name`` is not registered, or is the default ``"torch"``.
    """
    if name == DEFAULT_BACKEND:
        raise ValueError(f"the default backend {DEFAULT_BACKEND!r} cannot be unregistered")
    return _REGISTRY.pop(get_backend(name).name)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (available here or not).

    Raises:
        ValueError: no backend of that name is registered.
    """
    backend = _REGISTRY.get(name)
    if backend is None:
        raise ValueError(f"unknown MHLA backend {name!r}; registered: {sorted(_REGISTRY)}")
    return backend


def registered_backends() -> list[str]:
    """Every registered backend name, sorted (installed here or not)."""
    return sorted(_REGISTRY)


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` besides ``"auto"``, sorted: the registered backends that are
    installed here (whether one runs on given tensors: :func:`resolve_backend`)."""
    return sorted(name for name, backend in _REGISTRY.items() if backend.is_available())


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for tensors on ``device``; validate explicit names.

    ``"auto"``: the first registered backend (in registration order) whose
    :meth:`Backend.preferred_for_auto` is true for ``device``, else ``"torch"``. An explicit name:
    returned if that backend runs on ``device`` (:meth:`Backend.unsupported_reason`).

    Raises:
        ValueError: for an unknown backend name, or a backend that cannot run here (not installed,
            no driver, a device it does not take), naming the reason.
    """
    device = torch.device(device)
    if backend == "auto":
        for candidate in _REGISTRY.values():
            if candidate.name != DEFAULT_BACKEND and candidate.preferred_for_auto(device):
                return candidate.name
        return DEFAULT_BACKEND
    chosen = _REGISTRY.get(backend)
    if chosen is None:
        raise ValueError(f"unknown MHLA backend {backend!r}; choose one of {['auto', *available_backends()]}")
    problem = chosen.unsupported_reason(device)
    if problem is not None:
        raise ValueError(f"MHLA backend {backend!r} is not usable here: {problem}. Use backend='torch' or 'auto'")
    return backend


register_backend(TorchBackend())


# -- the deprecated ``BACKENDS`` dict (name -> forward function) ---------------------------------------


class _FunctionBackend(Backend):
    """A forward function set through ``BACKENDS[name] = fn``: everything else is the replaced
    backend's (or the defaults, for a new name)."""

    def __init__(self, name: str, fn: Callable, replaced: Backend | None):
        self.name, self._fn, self._replaced = name, fn, replaced
        self.fuses_rotary_tables = replaced is not None and replaced.fuses_rotary_tables

    def is_available(self) -> bool:
        return True if self._replaced is None else self._replaced.is_available()

    def unsupported_reason(self, device):
        return super().unsupported_reason(device) if self._replaced is None else self._replaced.unsupported_reason(device)

    def preferred_for_auto(self, device) -> bool:
        return self._replaced is not None and self._replaced.preferred_for_auto(device)

    def fuses_rotary(self, rotary, q, v) -> bool:
        return self._replaced is not None and self._replaced.fuses_rotary(rotary, q, v)

    def kept_on_load(self) -> bool:
        return True if self._replaced is None else self._replaced.kept_on_load()

    def forward(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class _Forwards(MutableMapping):
    """The registry seen as the former ``BACKENDS`` dict: name -> forward function."""

    def __getitem__(self, name):
        if name not in _REGISTRY:
            raise KeyError(name)
        return _REGISTRY[name].forward

    def __setitem__(self, name, fn):
        register_backend(_FunctionBackend(name, fn, _REGISTRY.get(name)), replace=True)

    def __delitem__(self, name):
        if name not in _REGISTRY:
            raise KeyError(name)
        unregister_backend(name)

    def __iter__(self):
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)


_FORWARDS = _Forwards()


def __getattr__(name: str):
    """``BACKENDS``: deprecated alias (a live mapping name -> forward); use :func:`get_backend`."""
    if name == "BACKENDS":
        warnings.warn(
            "mhla_diffusers.ops.backends.BACKENDS is deprecated: use get_backend / register_backend",
            DeprecationWarning, stacklevel=2,
        )
        return _FORWARDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
