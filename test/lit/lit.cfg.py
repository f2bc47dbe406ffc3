# -*- Python -*-
# lit configuration for GEIR's FileCheck tests: every `.geir` file under this folder is a test
# whose `// RUN:` lines run in lit's internal shell (no bash needed: `not`, pipes, `%s`, `%t`).
#
#   <venv>/bin/lit -v test/lit                  (the venv's bin folder need not be on PATH)
#   <venv>/bin/python -c "import sys, lit.main; sys.exit(lit.main.main())" -v test/lit
#   pytest                                      (test/lit/conftest.py runs lit once per session)
#
# (`python -m lit` does not start: the PyPI `lit` package has no `__main__` module.)
#
# Substitutions:
#   geopt        the geopt of the Python running lit (its bin folder, else `python -m geir.tools.geopt`)
#   gerun        gerun, found the same way
#   getune       getune, found the same way
#   filecheck    the Python FileCheck clone, found the same way
#   %{python}    that Python
#   %{exists}    exits 0 when the file named by its argument exists, 1 when it does not
#   %{expect-exit} N CMD...   runs CMD and exits 0 when its status is N (`not` only tells 0 from non-0)

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import lit.formats

config.name = "GEIR"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".geir"]
# helper folders and files beside the tests are not tests themselves
config.excludes = ["Inputs", "lit.cfg.py", "conftest.py", "README.md", "__pycache__"]
config.test_source_root = os.path.dirname(os.path.abspath(__file__))

# %t files live outside the source tree (the repository has no ignore rules for lit's Output/ folders)
_out = os.environ.get("GEIR_LIT_OUTPUT_DIR")
if not _out:
    _key = hashlib.sha1(config.test_source_root.encode()).hexdigest()[:10]
    _user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    _out = os.path.join(tempfile.gettempdir(), f"geir-lit-{_user}-{_key}")
config.test_exec_root = _out

_python = sys.executable
_bindir = os.path.dirname(_python)


def _q(word: str) -> str:
    return shlex.quote(word)


def _module_runs(module: str) -> bool:
    """Whether `python -m module --help` starts (the fallback when no script sits beside Python)."""
    try:
        done = subprocess.run([_python, "-m", module, "--help"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _tool(name: str, module: str) -> str:
    """The command line that runs `name`: the script beside sys.executable, else `python -m module`,
    else the script found on PATH."""
    for exe in (os.path.join(_bindir, name), os.path.join(_bindir, name + ".exe")):
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return _q(exe)
    if _module_runs(module):
        return f"{_q(_python)} -m {module}"
    found = shutil.which(name)
    if found:
        return _q(found)
    lit_config.fatal(f"cannot find {name}: install the test extras (pip install -e '.[test]')")


def _word(name: str) -> str:
    # the bare tool name as a command word, never a piece of a path, option or file name
    return r"(?<![\w/.\-=%])" + name + r"(?![\w/.\-])"


def _sub(text: str) -> str:
    # lit applies substitutions with re.sub: keep backslashes (Windows paths) literal
    return text.replace("\\", "\\\\")


config.substitutions.append(("%{python}", _sub(_q(_python))))
config.substitutions.append(
    ("%{exists}", _sub(f'{_q(_python)} -c "import os, sys; sys.exit(not os.path.exists(sys.argv[1]))"'))
)
config.substitutions.append(
    ("%{expect-exit}", _sub(f"{_q(_python)} {_q(os.path.join(config.test_source_root, 'Inputs', 'expect_exit.py'))}"))
)
config.substitutions.append((_word("geopt"), _sub(_tool("geopt", "geir.tools.geopt"))))
config.substitutions.append((_word("gerun"), _sub(_tool("gerun", "geir.tools.gerun"))))
config.substitutions.append((_word("getune"), _sub(_tool("getune", "geir.tools.getune"))))
config.substitutions.append((_word("filecheck"), _sub(_tool("filecheck", "filecheck"))))

# The tools run with lit's clean environment (which keeps PATH, for external commands) plus
# what they need to find the package and behave the same everywhere: PYTHONPATH (a checkout run
# without an install) and UTF-8 text streams so non-ASCII source lines echo the same in every locale.
config.environment.setdefault("PATH", os.environ.get("PATH", os.defpath))
for _var in ("PYTHONPATH", "SYSTEMROOT", "HOME"):
    if os.environ.get(_var):
        config.environment[_var] = os.environ[_var]
config.environment["PYTHONIOENCODING"] = "utf-8"
config.environment["PYTHONDONTWRITEBYTECODE"] = "1"
# diagnostics must not depend on the width or colours of a terminal
config.environment.pop("TERM", None)
