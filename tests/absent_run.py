"""Run Python as on an install that lacks some packages: ``python absent_run.py NAME[,NAME...] -c CODE`` or
``... -m MODULE [ARGS...]``. Importing any named top-level package (or its submodules) fails as if pip had
never installed it, so one venv with everything can stand in for a client-only install."""

from __future__ import annotations

import runpy
import sys


class _Absent:
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (absent from this install)", name=name)


def main(argv: list[str]) -> None:
    names, mode, target, *args = argv
    absent = set(names.split(","))
    already = sorted(m for m in sys.modules if m.split(".")[0] in absent)
    assert not already, f"imported before the blocker: {already}"
    sys.meta_path.insert(0, _Absent(absent))
    if mode == "-c":
        sys.argv = ["-c", *args]
        exec(compile(target, "<absent_run>", "exec"), {"__name__": "__main__"})  # noqa: S102 (as python -c does)
    elif mode == "-m":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"absent_run.py: expected -c CODE or -m MODULE, not {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
