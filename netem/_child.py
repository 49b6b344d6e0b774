"""Child side of `ProcessGroup.call_async`: unpickle a call from stdin, run it, pickle the outcome.

Usage (internal): `python -m netem._child RESULT_PATH` with two pickles on stdin: how to load
the parent's `__main__` (or None), then `(func, args, kwargs)`. Writes `("ok", value)` or `("error", traceback_text)` to RESULT_PATH.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pickle
import sys
import traceback
import types


def _load_main(ref: tuple[str, str] | None) -> None:
    """Make the parent's `__main__` importable here (as multiprocessing's spawn does).

    It runs under the name `__mp_main__`, so its `if __name__ == "__main__":` block does not.
    """
    if ref is None:
        return
    kind, where = ref
    if kind == "module":
        module = importlib.import_module(where)
    else:
        module = types.ModuleType("__mp_main__")
        module.__file__ = where
        sys.modules["__mp_main__"] = module
        with open(where, encoding="utf-8") as f:
            exec(compile(f.read(), where, "exec"), module.__dict__)
    sys.modules["__main__"] = module


def main() -> int:
    result_path = sys.argv[1]
    try:
        stdin = sys.stdin.buffer
        _load_main(pickle.load(stdin))
        func, args, kwargs = pickle.load(stdin)
        value = func(*args, **kwargs)
        if inspect.iscoroutine(value):  # an async def: run it on a fresh event loop
            value = asyncio.run(value)
        outcome = ("ok", value)
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        outcome = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception:
        outcome = ("error", f"the return value could not be pickled:\n{traceback.format_exc()}")
        data = pickle.dumps(outcome)
    with open(result_path, "wb") as f:
        f.write(data)
    return 0 if outcome[0] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
