"""Make ``from colossalai import cmap`` work without colossalai knowing about us.

The installed ``colossalai_cmap.pth`` imports this module at interpreter start-up. It must stay cheap: it imports
neither torch nor colossalai. It installs a one-shot ``sys.meta_path`` finder that wraps colossalai's loader, so that
once ``colossalai/__init__.py`` has run, ``colossalai.cmap`` resolves lazily through a module ``__getattr__``.
"""

# No typing/importlib.abc imports: this module runs at every interpreter start-up and must cost well under 10 ms.
import sys
from importlib.machinery import PathFinder

_TARGET = "colossalai"
_EXPORTS = ("cmap",)


def _module_getattr(module, previous):
    def __getattr__(name):
        if name in _EXPORTS:
            import colossalai_cmap

            value = getattr(colossalai_cmap, name)
            setattr(module, name, value)
            return value
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    return __getattr__


def patch(module) -> None:
    """Expose the lazy ``cmap`` attribute on an imported ``colossalai`` module (idempotent)."""
    current = module.__dict__.get("__getattr__")
    if getattr(current, "_colossalai_cmap", False):
        return
    hook = _module_getattr(module, current)
    hook._colossalai_cmap = True  # type: ignore[attr-defined]
    module.__getattr__ = hook  # type: ignore[method-assign]


class _PatchingLoader:
    """Delegates to colossalai's own loader, then patches the module once it has executed."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """Finds ``colossalai`` with the other finders and wraps its loader; then removes itself."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET or self._busy:
            return None
        self._busy = True
        try:
            spec = PathFinder.find_spec(fullname, path)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Register ``colossalai.cmap``: patch colossalai now if it is imported, else when it is."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        patch(module)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
