"""What a user names in the config by import path ('module:attr' or 'module:Outer.attr'), imported
with an error that says what to fix, for rewards (`reward.functions`) and environments (`rollout.env`)."""

from __future__ import annotations

import importlib
from typing import Any

from async_april.errors import short_repr


def import_object(path: str, where: str, kind: str, error: type[Exception]) -> Any:
    """The object at `path`. `where` opens every message (e.g. "reward 'x'"); `kind` is what the part after
    the ':' names ("function", "class"); `error` is raised, once, with the problem and the fix."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise error(f"{where}: an import path must look like 'module:{kind}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{where}: cannot import module {module_name} ({exc}); check the name and that the module "
                    "is on PYTHONPATH (the job's working_dir on a cluster)") from None
    except SystemExit as exc:  # sys.exit() at import is a BaseException: it would end this process silently
        raise error(f"{where}: importing module {module_name} called sys.exit({short_repr(exc.code, 60)}); a module "
                    "named in the config must not exit; fix that module") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing; say where
        raise error(f"{where}: importing module {module_name} raised {type(exc).__name__}: {short_repr(str(exc), 200)}; "
                    "fix that module") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{where}: module {module_name} has no attribute {attr}; check the {kind} name after the ':'")
        obj = getattr(obj, part)
    return obj
