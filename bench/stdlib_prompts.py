"""HumanEval-style code-completion seed prompts from the Python standard library's documented functions:
`def name(signature):` and the docstring's first paragraph, for the target to write the body. Distinct code
prompts for distilling a head where no code dataset can be downloaded (HumanEval holds 164 problems).
The module list is fixed and sorted; the functions found depend on the Python version, so the output is
kept in bench/seeds/stdlib_code.jsonl (made with Python 3.11: 671 prompts; none is a HumanEval problem).

    python bench/stdlib_prompts.py > bench/seeds/stdlib_code.jsonl
"""
import importlib, inspect, json, sys, textwrap, warnings
warnings.simplefilter("ignore")
MODULES = sorted("""abc argparse ast base64 bisect calendar cgi cmd codecs colorsys configparser copy csv dataclasses
datetime decimal difflib dis email.utils enum filecmp fileinput fnmatch fractions ftplib functools getopt gettext
glob gzip hashlib heapq hmac html html.parser http.cookies imaplib inspect ipaddress itertools json keyword
linecache locale logging mailbox mimetypes netrc ntpath numbers operator optparse os os.path pathlib pickle
pkgutil platform plistlib poplib posixpath pprint profile pstats py_compile queue quopri random re reprlib
sched secrets selectors shelve shlex shutil smtplib socket socketserver statistics string struct subprocess
sysconfig tabnanny tarfile tempfile textwrap threading timeit token tokenize trace traceback turtle types
typing urllib.parse urllib.request uu uuid warnings wave weakref webbrowser xml.dom.minidom xml.etree.ElementTree
zipfile zipimport""".split())
out, seen = [], set()
for m in MODULES:
    try:
        mod = importlib.import_module(m)
    except Exception:
        continue
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
            continue
        doc = inspect.getdoc(obj)
        if not doc or len(doc) < 40 or (m, name) in seen:
            continue
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            continue
        if len(sig) > 100 or "<" in sig:
            continue
        para = doc.split("\n\n")[0].strip()
        if len(para) > 400:
            continue
        seen.add((m, name))
        body = textwrap.indent(para, "    ")
        out.append({"prompt": f'def {name}{sig}:\n    """{body.strip()}\n    """\n'})
print(len(out), file=sys.stderr)
for r in out:
    print(json.dumps(r))
