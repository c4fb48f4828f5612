"""``alignkit ARGS`` in a process forked from a warm fork server (``tests/conftest.py:run_cli``).

A one-process CLI run in a fresh interpreter spends ~7 s of CPU importing torch and transformers before it does
anything; the suite starts a few hundred of them. The fork server imports those once (``PRELOAD``) and forks a
child per run: the child starts from that state (nothing of an earlier run), sets the run's environment, working
directory, ``sys.argv`` and ``sys.path`` as ``python -m alignkit ARGS`` would, points file descriptors 1 and 2 at
files, and exits with ``main``'s status (an uncaught exception: its traceback on stderr and status 1, as the
interpreter does). alignkit itself is imported in the child, after the environment is set.

This module imports only the standard library: it is imported by the fork server before anything else.
"""

from __future__ import annotations

import os
import sys

#: imported once by the fork server (an import error there is ignored, and the child imports it again)
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch", "yaml"]


def run(args: list[str], cwd: str | None, env: dict[str, str], stdout: str, stderr: str,
        prelude: str | None = None) -> None:
    """The child: ``python -m alignkit ARGS`` in this process (never returns: exits with its status), after
    ``prelude`` (Python source: a fault a test injects into alignkit's code) when given."""
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # python -m puts the working directory first (e.g. reward modules there)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        if prelude is not None:
            exec(compile(prelude, "<prelude>", "exec"), {"__name__": "__prelude__"})  # noqa: S102 (a test's own code)
        from alignkit.cli import main

        sys.argv = [os.path.join(os.path.dirname(sys.modules["alignkit"].__file__ or ""), "__main__.py"), *args]
        code = main(args)
    except SystemExit as e:  # as the interpreter: None is 0, an int is the status, anything else printed and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()  # an interpreter's exit runs them; a multiprocessing child does not
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code or 0)
