"""HumanEval-style code-completion seed prompts from the Python standard library's documented functions:
`def name(signature):` and the docstring's first paragraph, for the target to write the body. Distinct code
prompts for distilling a head where no code dataset can be downloaded (HumanEval holds 164 problems).
The module list is fixed and sorted; the functions found depend on the Python version, so the output is
kept in bench/seeds/stdlib_code.jsonl (made with Python 3.11: 671 prompts, none a HumanEval problem; 652
distinct: `os.path` repeats `posixpath`, kept as the 2026-12-03 experiment used it; bench/distill_smollm2.py
reads the distinct ones).

    python bench/stdlib_prompts.py > bench/seeds/stdlib_code.jsonl
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings

MODULES = sorted("""abc argparse ast base64 bisect calendar cgi cmd codecs colorsys configparser copy csv dataclasses
datetime decimal difflib dis email.utils enum filecmp fileinput fnmatch fractions ftplib functools getopt gettext
glob gzip hashlib heapq hmac html html.parser http.cookies imaplib inspect ipaddress itertools json keyword
linecache locale logging mailbox mimetypes netrc ntpath numbers operator optparse os os.path pathlib pickle
pkgutil platform plistlib poplib posixpath pprint profile pstats py_compile queue quopri random re reprlib
sched secrets selectors shelve shlex shutil smtplib socket socketserver statistics string struct subprocess
sysconfig tabnanny tarfile tempfile textwrap threading timeit token tokenize trace traceback turtle types
typing urllib.parse urllib.request uu uuid warnings wave weakref webbrowser xml.dom.minidom xml.etree.ElementTree
zipfile zipimport""".split())


def prompt(name: str, fn) -> str | None:
    """The prompt for one public function: a signature under 100 characters, a docstring of 40+
    characters whose first paragraph is at most 400."""
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 40:
        return None
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    para = doc.split("\n\n")[0].strip()
    if len(sig) > 100 or "<" in sig or len(para) > 400:
        return None
    return f'def {name}{sig}:\n    """{para.replace(chr(10), chr(10) + "    ")}\n    """\n'


def prompts() -> list[str]:
    out = []
    for m in MODULES:
        try:
            mod = importlib.import_module(m)
        except Exception:  # removed in this Python (cgi, uu, ...)
            continue
        for name, obj in sorted(vars(mod).items()):
            if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                out += [p] if (p := prompt(name, obj)) else []
    return out


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # deprecated modules warn on import
    made = prompts()
    print(f"{len(made)} prompts", file=sys.stderr)
    sys.stdout.write("".join(json.dumps({"prompt": p}) + "\n" for p in made))
