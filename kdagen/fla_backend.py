"""kdagen as a backend of fla-core 0.6's chunk_kda (fla.backends): with kdagen imported, fla's
own `fla.ops.kda.chunk_kda` is served by kdagen wherever kdagen's verifier accepts the call,
and by fla's Triton path otherwise, with the reason logged (by fla once per backend, at INFO on
the `fla.backends` logger, and by kdagen once per distinct reason on the `kdagen` logger).

Registered when kdagen is imported: at once if fla is already imported, else right after
`fla.ops.kda` is (an import hook; importing kdagen alone never imports torch or fla). Opt out
with KDAGEN_FLA_BACKEND=0 (read at import, and by fla on every call). fla orders backends by
priority, lower first: kdagen takes 2, ahead of FlashKDA (3).

The verifier accepts what kdagen.chunk_kda runs: inference (no grad mode), fla-core 0.6's
keywords (a cp_context included, run by kdagen.cp), and a call a variant can serve (selection
runs in the verifier, building on demand where that is allowed); its answer is kept per call
signature.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable, Optional

log = logging.getLogger("kdagen")

BACKEND_TYPE = "kdagen"
ENV_VAR = "KDAGEN_FLA_BACKEND"
PRIORITY = 2
_HOOK_MODULE = "fla.ops.kda"
_state = {"installed": False, "registered": False}


def install() -> None:
    """Register now if fla's chunk_kda is loaded, else when it is (idempotent)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    from . import env
    from .errors import KdagenError

    try:
        enabled = env.fla_backend()
    except KdagenError as e:
        log.warning("kdagen: not registering the fla backend: %s", e)
        return
    if not enabled:
        return
    if _HOOK_MODULE in sys.modules and "fla.backends" in sys.modules:
        _register_safely()
    else:
        sys.meta_path.insert(0, _AfterImport(_HOOK_MODULE, _register_safely))


def _register_safely() -> None:
    try:
        register()
    except Exception as e:  # never break the user's import of fla
        log.warning("kdagen: could not register the fla backend: %s: %s", type(e).__name__, e)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback` once, right after module `name` has executed."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot, and the real finders below find the spec
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.callback)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callback: Callable[[], None]) -> None:
        self.inner, self.callback = inner, callback

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.callback()

    def __getattr__(self, name: str):  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


_MEMO: dict = {}
_MEMO_LIMIT = 4096
_DECLINED: set = set()


_PLAIN = (bool, int, float, str)


def _meta(t) -> Any:
    if t is None or not hasattr(t, "dtype"):
        return t if t is None or isinstance(t, _PLAIN) else (_context_key(t) or type(t).__name__)
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.device, t.requires_grad)


# The latest verified call: (keyword names, its non-tensor values, a check of its tensors'
# signatures (kdagen.signature_guard), verdict). A model's layers repeat one call, and this check
# costs a third of building _MEMO's key. Made once per _MEMO key (_SHORTCUTS): calls that alternate
# between signatures switch among them instead of building a guard each time.
_LATEST: list = [None]
_SHORTCUTS: dict = {}


def _split(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """A call's values in order (positional, then keyword) as (the non-tensor values with None in
    the tensors' slots, the tensors with None in the others' slots)."""
    import torch

    vals = args + tuple(kwargs.values())
    return (tuple(None if isinstance(x, torch.Tensor) else x if x is None or isinstance(x, _PLAIN)
                  else (_context_key(x) or x) for x in vals),
            tuple(x if isinstance(x, torch.Tensor) else None for x in vals))


def _context_key(x) -> Optional[tuple]:
    """A cp_context's key (fla's or kdagen's, as kdagen.cp recognises them), else None: a verdict
    does not hang on a context's offsets, and its fields (tensors among them) do not compare as
    one value."""
    from .cp import CPContext, _is_fla_context

    if isinstance(x, CPContext) or _is_fla_context(x):
        return ("cp_context", type(x).__name__, getattr(x, "layout", "contiguous"))
    return None


def _latest_verdict(args: tuple, kwargs: dict) -> Optional[tuple[bool, Optional[str]]]:
    latest = _LATEST[0]
    if latest is None:
        return None
    names, others, check, verdict = latest
    if tuple(kwargs) != names:
        return None
    mine, tensors = _split(args, kwargs)
    try:
        same = others == mine and check(*tensors)
    except Exception:  # a value that does not compare: the key below decides
        return None
    return verdict if same is True else None


def _remember(key: tuple, args: tuple, kwargs: dict, verdict: tuple[bool, Optional[str]]) -> None:
    from .signature_guard import make_check

    others, tensors = _split(args, kwargs)
    entry = _SHORTCUTS.get(key)
    if entry is None or entry[0] != tuple(kwargs) or entry[1] != others:
        check = make_check(tensors)
        entry = None if check is None else (tuple(kwargs), others, check, verdict)
        if len(_SHORTCUTS) >= _MEMO_LIMIT:
            _SHORTCUTS.pop(next(iter(_SHORTCUTS)))
        _SHORTCUTS[key] = entry
    _LATEST[0] = entry


def verify(*args, **kwargs) -> tuple[bool, Optional[str]]:
    """fla's verifier protocol: (True, None), or (False, why kdagen declines this call)."""
    import torch

    if torch.is_grad_enabled():
        hit = (False, "kdagen serves inference only (grad mode is on: run under torch.inference_mode())")
    else:
        hit = _latest_verdict(args, kwargs)
        if hit is None:
            key = (tuple(_meta(a) for a in args), tuple(sorted((n, _meta(a)) for n, a in kwargs.items())))
            hit = _MEMO.get(key)
            if hit is None:
                hit = _verify(args, kwargs)
                if len(_MEMO) >= _MEMO_LIMIT:
                    _MEMO.pop(next(iter(_MEMO)))
                _MEMO[key] = hit
            _remember(key, args, kwargs, hit)
    if not hit[0] and hit[1] not in _DECLINED:
        _DECLINED.add(hit[1])
        log.info("kdagen: fla chunk_kda falls back to fla: %s", hit[1])
    return hit


def _verify(args, kwargs) -> tuple[bool, Optional[str]]:
    from . import fla_compat
    from .errors import KdagenError

    try:
        fla_compat.plan(fla_compat.translate(*args, **kwargs))
    except (KdagenError, TypeError) as e:
        return False, " ".join(str(e).split())  # one line: fla logs it on one
    return True, None


def serve(*args, **kwargs):
    from . import fla_compat

    return fla_compat.chunk_kda(*args, **kwargs)


def register() -> None:
    """Add the kdagen backend to fla's chunk_kda registry (fla must be importable)."""
    from fla.backends import BaseBackend
    from fla.backends import register as fla_register
    from fla.ops.kda.chunk import chunk_kda

    class KdagenBackend(BaseBackend):
        """kdagen's generated KDA prefill kernels (forward, inference only)."""

        backend_type = BACKEND_TYPE
        package_name = "kdagen"
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, Optional[str]]:
            return verify(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return serve(*args, **kwargs)

    fla_register(chunk_kda)(KdagenBackend)
    _state["registered"] = True
    log.debug("kdagen: registered as fla chunk_kda backend %r (priority %d)", BACKEND_TYPE, PRIORITY)


def registered() -> bool:
    return _state["registered"]
