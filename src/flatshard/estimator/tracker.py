"""Live tensor storage bytes and their peak, op by op: the memory measure of the estimator and of its checks.

[Note: what the memory tracker measures]
There is no allocator statistic for CPU tensors, and none at all for meta tensors, so memory is measured the
same way in the estimator's dry run (meta tensors) and in the real runs that check it (CPU tensors): a
``TorchDispatchMode`` sees every operator call, registers the storage of each tensor among its arguments and
results the first time it appears, and forgets it when the storage object dies (a weak reference's callback).
After every operator the live total is the sum of the registered storages' sizes, and its maximum is the peak.
So the peak is taken where allocations happen, with an operator's inputs and outputs both alive; an
operator's internal scratch memory is not seen.

Storages that exist before tracking starts (the shards, the optimizer state) are registered up front with
:meth:`StorageTracker.watch`. The gathered flat parameters keep one storage object whose size the engine
changes (freed to zero after use, allocated again for the next gather), so their sizes are read at every
operator rather than once (:meth:`StorageTracker.watch_resizable`). A DTensor operator (tensor parallelism) is
declined, so that DTensor runs it and the operators on its local tensors, which hold the storage, come back here. Memory that no tensor storage holds (the
CUDA context, the communication library's buffers, a CPU allocator's cached blocks) is not in this measure.

With ``log`` the tracker also keeps the step's allocations and frees in order (:attr:`StorageTracker.allocations`):
what the estimator replays on real memory to measure the CPU allocator's share of a rank's RSS (see [Note: a
rank's runtime] in ``runtime.py``).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["StorageTracker", "dtensor_type"]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def dtensor_type() -> type | None:
    """torch's DTensor class (``None`` in a build without distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a build without distributed
        return None
    return DTensor


class StorageTracker(TorchDispatchMode):
    """Tracks live storage bytes and their peak inside a ``with`` block.

    Args:
        categories: optional ``name -> predicate(storage)`` used to split the live bytes at the peak (a
            storage is counted in the first category whose predicate accepts it, else in ``"other"``).
        count_flops: also count the operators' floating-point operations (torch's FLOP formulas) and keep a
            ``(time, flops so far)`` trace, which places collectives between compute (see ``timing``).
        log: also record every allocation and free in :attr:`allocations`; the predicate says which storages are
            blocks the engine maps itself (the resizable ones always are).
    """

    def __init__(
        self,
        categories: dict[str, Callable[[torch.UntypedStorage], bool]] | None = None,
        count_flops: bool = False,
        log: Callable[[torch.UntypedStorage], bool] | None = None,
    ) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes when registered
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._resizable: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._fixed = 0  # sum of _sizes
        self.peak = 0
        self.peak_breakdown: dict[str, int] = {}
        self.ops = 0
        self._categories = categories or {}
        self.resizable_peak = 0  # the most bytes the resizable storages held at once
        self.flops = 0  # floating-point operations of the operators seen (with count_flops)
        self._count_flops = count_flops
        self.trace: list[tuple[int, int]] = []  # (perf_counter_ns after an operator, flops so far)
        self._log = log
        # (key, bytes, mapped by the engine) per allocation, (key, -1, False) per free; keys number storages
        self.allocations: list[tuple[int, int, bool]] = []
        self._log_keys: dict[int, int] = {}  # id(storage) -> its key in ``allocations``
        self._logged_sizes: dict[int, int] = {}  # resizable storages: the size last logged
        self._next_key = 0
        self._dtensor = dtensor_type()

    # ------------------------------------------------------------------ registration
    def _forget(self, key: int) -> None:
        self._fixed -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        logged = self._log_keys.pop(key, None)
        if logged is not None:
            self.allocations.append((logged, -1, False))

    def _logged(self, key: int) -> int:
        """A new key in ``allocations`` for the storage ``key`` (an id, which a later storage may reuse)."""
        self._log_keys[key] = logged = self._next_key
        self._next_key += 1
        return logged

    def _forgotten(self, key: int, _ref: object) -> None:
        self._forget(key)

    def _register(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._refs or key in self._resizable:
            return
        try:
            ref = weakref.ref(st, functools.partial(self._forgotten, key))
        except TypeError:
            return
        self._refs[key] = ref
        nbytes = int(st.nbytes())
        self._sizes[key] = nbytes
        self._fixed += nbytes
        if self._log is not None:
            self.allocations.append((self._logged(key), nbytes, self._log(st)))

    def watch(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Register the storages of ``tensors`` (tensors alive before the block, e.g. shards and states)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None:
                    self._register(st)

    def watch_resizable(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register storages whose size changes in place (gathered flat parameters): read at every operator."""
        for t in tensors:
            st = _storage(t)
            if st is None:
                continue
            key = id(st)
            if key in self._refs:
                self._forget(key)
            self._resizable[key] = weakref.ref(st)
            if self._log is not None:
                self._logged(key)

    # ------------------------------------------------------------------ measuring
    def live(self) -> int:
        """Bytes of the registered storages that are alive now."""
        return self._fixed + self.resizable_bytes()

    def resizable_bytes(self) -> int:
        total = 0
        for key, ref in self._resizable.items():
            st = ref()
            nbytes = int(st.nbytes()) if st is not None else 0
            total += nbytes
            if self._log is not None and nbytes != self._logged_sizes.get(key, 0):
                self._log_resize(key, nbytes)
        return total

    def _log_resize(self, key: int, nbytes: int) -> None:
        """A resizable storage freed, allocated again, or both since the last look."""
        logged = self._log_keys[key]
        if self._logged_sizes.get(key, 0):
            self.allocations.append((logged, -1, False))
        if nbytes:
            self.allocations.append((logged, nbytes, True))
        self._logged_sizes[key] = nbytes

    def sample(self) -> int:
        """Take the live total now (also called after every operator); returns it."""
        resizable = self.resizable_bytes()
        self.resizable_peak = max(self.resizable_peak, resizable)
        now = self._fixed + resizable
        if now > self.peak:
            self.peak = now
            self.peak_breakdown = self._breakdown()
        return now

    def reset_peak(self) -> None:
        self.peak = self.resizable_peak = 0
        self.peak_breakdown = {}
        self.sample()

    def _breakdown(self) -> dict[str, int]:
        if not self._categories:
            return {}
        out = dict.fromkeys(self._categories, 0)
        out["other"] = 0
        refs = list(self._refs.values()) + list(self._resizable.values())
        for ref in refs:
            st = ref()
            if st is None:
                continue
            name = next((n for n, accept in self._categories.items() if accept(st)), "other")
            out[name] += int(st.nbytes())
        return out

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self._dtensor is not None and any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # DTensor runs first: its operators on local tensors come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None:
                    self._register(st)
        self.ops += 1
        if self._count_flops:
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                self.flops += int(count(*args, **kwargs, out_val=out))
            self.trace.append((time.perf_counter_ns(), self.flops))
        self.sample()
        return out
