"""Model helpers: the locally built tiny model and model-path resolution.

Imported lazily so that `import async_april.models` pulls in neither torch
nor transformers.
"""

_EXPORTS = ("build_random_tiny_model", "ensure_tiny_model", "resolve_model_path")

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name == "resolve_model_path":
        from async_april.models import paths

        return paths.resolve_model_path
    if name in _EXPORTS:
        from async_april.models import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
