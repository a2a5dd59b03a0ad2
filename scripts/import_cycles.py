#!/usr/bin/env python3
"""Find files that import each other in a loop (import cycles) in Rust crates and Python packages.

Usage:
  scripts/import_cycles.py [DIR...]   DIR: a Rust crate's source folder (with lib.rs, main.rs or
                                      bin/*.rs) and/or a Python package folder; default: the
                                      repository's generator/src, kernels/src, kernels/harness/src,
                                      python/src and python/deepep_kernels
Prints each cycle as the list of its files, then one line per import that closes the loop
(`file:line -> file  (path as written)`), and exits 1 when there is any cycle, 0 when there is
none, 2 on bad input (a folder that does not exist, .rs files without a crate root).

What counts as "file A imports file B":
- Rust: a `use` of a `crate::`, `super::` or `self::` path (or of a child module, as in
  `pub use comm::Comm`), and any `crate::x::..`, `super::x::..`, `self::x::..` path in code
  (function bodies, types, `$crate::` in macros), mapped to the file that defines the module the
  path names: its longest prefix that is a module, found through the crate's `mod` declarations
  (`#[path]` included). `crate::runtime::comm::Comm` is runtime/comm.rs; `super::Gpu` is the
  parent's file even when the parent only re-exports `Gpu`; `crate::args![..]` (a macro) is the
  crate root's. Comments, doc comments and string literals are not code and never count. A
  `mod child;` declaration is not an import of the child.
- Python: `import pkg.x`, `from pkg.x import y`, `from . import x`, `from .x import y`, `from .. import
  z`, at any place in the file (a function-level or `if TYPE_CHECKING:` import is still an import:
  moving an import into a function hides a loop, it does not open it). `from . import x` names the
  file x.py (or the package x/) when there is one, else the package's `__init__.py`.
- A file and the files of its enclosing modules (in Rust the parent's file up to lib.rs; in Python
  the enclosing packages' `__init__.py`) form one tree: the parent declares and re-exports its
  children, a child uses its parent's items (`super::Shared`, `from . import name_in_init`). Such
  parent <-> descendant references are not counted, in either direction. Every other pair counts:
  siblings (runtime/comm.rs <-> runtime/exchange.rs), cousins (gpu_test.rs <-> cases/intranode.rs),
  and modules of different packages.
A cycle is a set of two or more files each reachable from the others (a strongly connected
component); one line per import inside it says where to cut. Files that no `mod` declaration
reaches are not compiled and are left out. Third-party crates and packages are not followed.
"""

from __future__ import annotations

import ast
import bisect
import os
import re
import sys
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIRS = ["generator/src", "kernels/src", "kernels/harness/src", "python/src", "python/deepep_kernels"]


class InputError(Exception):
    """Bad input (exit 2): the message names the problem and the fix."""


@dataclass
class Edge:
    src: str  # file that imports
    dst: str  # file imported
    line: int
    what: str  # the path as written


# ---------------------------------------------------------------------------------------------
# Rust
# ---------------------------------------------------------------------------------------------

_RAW_STR = re.compile(r'(?:br|cr|r)(#*)"')
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|::|[{}();,*$!#\[\]=]|\S")
_PATH_ATTR = re.compile(r'#\s*\[\s*path\s*=\s*"([^"]+)"\s*\]')


def _blank(s: str) -> str:
    return re.sub(r"[^\n]", " ", s)


def strip_rust(src: str) -> str:
    """`src` with comments and the contents of string and char literals replaced by spaces
    (newlines kept, so offsets and line numbers stay those of the file)."""
    out: list[str] = []
    i, n = 0, len(src)
    plain_from = 0
    while i < n:
        c = src[i]
        end = -1
        if c == "/" and src.startswith("//", i):
            end = src.find("\n", i)
            end = n if end < 0 else end
        elif c == "/" and src.startswith("/*", i):
            depth, end = 0, i
            while end < n:
                if src.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif src.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                    if depth == 0:
                        break
                else:
                    end += 1
        elif c in "bcr" and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")) and _RAW_STR.match(src, i):
            m = _RAW_STR.match(src, i)
            close = src.find('"' + m.group(1), m.end())
            end = n if close < 0 else close + 1 + len(m.group(1))
        elif c == '"' or (c in "bc" and src.startswith('"', i + 1) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"))):
            j = i + (1 if c == '"' else 2)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            end = min(j + 1, n)
        elif c == "'":
            if src.startswith("\\", i + 1):  # '\n', '\'', '\u{..}'
                close = src.find("'", i + 3)
                end = n if close < 0 else close + 1
            elif i + 2 < n and src[i + 2] == "'":  # 'x'
                end = i + 3
            # else a lifetime or loop label: code
        if end < 0:
            i += 1
            continue
        out.append(src[plain_from:i])
        out.append(_blank(src[i:end]))
        i = plain_from = end
    out.append(src[plain_from:])
    return "".join(out)


@dataclass
class RustModule:
    path: tuple  # module path inside the crate, () for the crate root
    file: str
    children: set = field(default_factory=set)


@dataclass
class RustRef:
    module: tuple  # the module the reference is written in
    segs: list  # the module part of the path as written, split at ::
    line: int


@dataclass
class RustCrate:
    root: str
    modules: dict = field(default_factory=dict)  # module path -> RustModule
    refs: dict = field(default_factory=dict)  # file -> [RustRef]
    file_module: dict = field(default_factory=dict)  # file -> the module path of the whole file


def _is_ident(t: str) -> bool:
    return bool(re.match(r"[A-Za-z_]", t))


def _use_paths(toks: list, i: int, prefix: list, out: list) -> int:
    """Parse the use tree at toks[i] and append the path of each leaf (`a::b::{c, d::*}` gives
    a::b::c and a::b::d; `self` in braces names the prefix). Returns the index after the tree."""
    segs = list(prefix)
    if i < len(toks) and toks[i] == "::":  # `use ::std::x`: another crate
        segs.append("::")
        i += 1
    while i < len(toks):
        t = toks[i]
        if t == "{":
            i += 1
            while i < len(toks) and toks[i] != "}":
                i = i + 1 if toks[i] == "," else _use_paths(toks, i, segs, out)
            return i + 1
        if t == "*":
            out.append(segs)
            return i + 1
        if not _is_ident(t):
            return i + 1  # not a use tree we understand: skip the token
        i += 1
        if t != "self" or not segs:
            segs = segs + [t]
        if i < len(toks) and toks[i] == "::":
            i += 1
            continue
        if i + 1 < len(toks) and toks[i] == "as":
            i += 2
        out.append(segs)
        return i
    return i


def _scan_rust_file(crate: RustCrate, file: str, modpath: tuple, child_dir: str, pending: list) -> None:
    """Record the modules `file` defines (inline ones too), the paths it references, and queue
    the files of its `mod x;` declarations in `pending`."""
    with open(file, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    code = strip_rust(raw)
    newlines = [m.start() for m in re.finditer("\n", code)]
    toks = [(m.group(0), m.start()) for m in _TOKEN.finditer(code)]
    words = [t for t, _ in toks]
    crate.file_module[file] = modpath
    crate.modules[modpath] = RustModule(modpath, file)
    refs = crate.refs.setdefault(file, [])

    def ref(module: tuple, segs: list, pos: int) -> None:
        refs.append(RustRef(module, segs, bisect.bisect_right(newlines, pos - 1) + 1))

    # (module path, brace depth inside it, folder of its `mod x;` files), innermost last
    stack = [(modpath, 0, child_dir)]
    depth = 0
    inline_next = None  # the name of a `mod name {` whose brace comes next
    item_start = 0  # offset after the previous `;`, `{` or `}`: the next item's attributes start there
    i = 0
    while i < len(toks):
        t, pos = toks[i]
        cur_path, _, cur_dir = stack[-1]
        if t == "{":
            depth += 1
            if inline_next is not None:
                crate.modules[cur_path].children.add(inline_next)
                path = cur_path + (inline_next,)
                crate.modules[path] = RustModule(path, file)
                stack.append((path, depth, os.path.join(cur_dir, inline_next)))
                inline_next = None
            item_start = pos + 1
        elif t == "}":
            if len(stack) > 1 and depth == stack[-1][1]:
                stack.pop()
            depth -= 1
            item_start = pos + 1
        elif t == ";":
            item_start = pos + 1
        elif t == "mod" and i + 2 < len(toks) and _is_ident(words[i + 1]) and words[i + 2] in ("{", ";"):
            name = words[i + 1]
            if words[i + 2] == "{":
                inline_next = name
                i += 2
                continue
            crate.modules[cur_path].children.add(name)
            attr = _PATH_ATTR.search(raw[item_start:pos])
            if attr:  # relative to the file's folder (to the inline module's folder inside one)
                cands = [os.path.join(os.path.dirname(file) if len(stack) == 1 else cur_dir, attr.group(1))]
            else:
                cands = [os.path.join(cur_dir, name + ".rs"), os.path.join(cur_dir, name, "mod.rs")]
            found = next((c for c in cands if os.path.isfile(c)), None)
            if found:
                own_folder = os.path.basename(found) == "mod.rs"
                sub_dir = os.path.dirname(found) if own_folder else os.path.join(os.path.dirname(found), name)
                pending.append((found, cur_path + (name,), sub_dir))
            i += 3
            continue
        elif t == "use" and (i == 0 or words[i - 1] != "::"):
            j, level = i + 1, 0
            while j < len(toks) and not (words[j] == ";" and level == 0):
                level += (words[j] == "{") - (words[j] == "}")
                j += 1
            leaves: list = []
            _use_paths(words[i + 1 : j], 0, [], leaves)
            for segs in leaves:
                ref(cur_path, segs, pos)
            item_start = toks[j][1] + 1 if j < len(toks) else len(code)
            i = j + 1
            continue
        elif t in ("crate", "super", "self") and i + 1 < len(toks) and words[i + 1] == "::" and (i == 0 or words[i - 1] != "::"):
            segs = [t]
            j = i + 1
            while j + 1 < len(toks) and words[j] == "::" and _is_ident(words[j + 1]):
                segs.append(words[j + 1])
                j += 2
            if j < len(toks) and words[j] == "!":
                segs.pop()  # a macro: `crate::name!` (macro_export puts it at the crate root)
            ref(cur_path, segs, pos)
            i = j
            continue
        i += 1


def _absolute(crate: RustCrate, module: tuple, segs: list):
    """The path from the crate root of `segs` written in `module`, or None (another crate's)."""
    if not segs or segs[0] == "::":
        return None
    if segs[0] == "crate":
        return tuple(segs[1:])
    if segs[0] == "self":
        return module + tuple(segs[1:])
    if segs[0] == "super":
        base, rest = module, list(segs)
        while rest and rest[0] == "super":
            if not base:
                return None  # `super` above the crate root: rustc refuses it
            base, rest = base[:-1], rest[1:]
        return base + tuple(rest)
    mod = crate.modules.get(module)
    if mod is not None and segs[0] in mod.children:  # `use comm::Comm` (a child module, 2018 paths)
        return module + tuple(segs)
    return None


def _module_file(crate: RustCrate, path: tuple):
    """The file that defines the deepest module named by a prefix of `path` (`crate::a::b::Item`
    -> the file of module a::b)."""
    mod = ()
    for name in path:
        info = crate.modules.get(mod)
        if info is None or name not in info.children:
            break
        mod = mod + (name,)
    info = crate.modules.get(mod)
    return info.file if info else None



def _crate_roots(src_dir: str) -> list:
    roots = [os.path.join(src_dir, f) for f in ("lib.rs", "main.rs") if os.path.isfile(os.path.join(src_dir, f))]
    bin_dir = os.path.join(src_dir, "bin")
    if os.path.isdir(bin_dir):
        for name in sorted(os.listdir(bin_dir)):
            p = os.path.join(bin_dir, name)
            if name.endswith(".rs") and os.path.isfile(p):
                roots.append(p)
            elif os.path.isfile(os.path.join(p, "main.rs")):
                roots.append(os.path.join(p, "main.rs"))
    return roots


def rust_edges(src_dir: str) -> tuple:
    """(edges, files) of the crates whose roots are in `src_dir`."""
    edges: list = []
    files: set = set()
    for root in _crate_roots(src_dir):
        crate = RustCrate(root)
        pending = [(root, (), os.path.dirname(root))]
        while pending:
            file, modpath, child_dir = pending.pop()
            if file in crate.file_module:
                continue
            _scan_rust_file(crate, file, modpath, child_dir, pending)
        files.update(crate.file_module)
        for file, refs in crate.refs.items():
            mine = crate.file_module[file]
            for r in refs:
                absolute = _absolute(crate, r.module, r.segs)
                if absolute is None:
                    continue
                target = _module_file(crate, absolute)
                if target is None or target == file:
                    continue
                theirs = crate.file_module[target]
                if mine[: len(theirs)] == theirs or theirs[: len(mine)] == mine:
                    continue  # parent <-> descendant: one module tree
                edges.append(Edge(file, target, r.line, "::".join(r.segs)))
    return edges, files


# ---------------------------------------------------------------------------------------------
# Python
# ---------------------------------------------------------------------------------------------


def python_edges(pkg_dir: str) -> tuple:
    """(edges, files) of the Python modules under `pkg_dir` (a package folder, or a folder of
    top-level modules when it has no __init__.py)."""
    prefix = (os.path.basename(os.path.normpath(pkg_dir)),) if os.path.isfile(os.path.join(pkg_dir, "__init__.py")) else ()
    modules: dict = {}  # dotted tuple -> file
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        rel = os.path.relpath(dirpath, pkg_dir)
        parts = () if rel == "." else tuple(rel.split(os.sep))
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext not in (".py", ".pyi"):
                continue
            dotted = prefix + parts + (() if stem == "__init__" else (stem,))
            path = os.path.join(dirpath, name)
            if ext == ".py" or dotted not in modules:
                modules[dotted] = path
    by_file = {f: m for m, f in modules.items()}
    packages = {m for m, f in modules.items() if os.path.basename(f).startswith("__init__.")}

    def target_of(dotted: tuple):
        """The file of the longest prefix of `dotted` that is one of our modules."""
        for k in range(len(dotted), 0, -1):
            if dotted[:k] in modules:
                return modules[dotted[:k]]
        return None

    edges: list = []
    for file, mod in sorted(by_file.items()):
        try:
            with open(file, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=file)
        except SyntaxError as e:
            raise InputError(f"{file}:{e.lineno}: not valid Python ({e.msg}); fix the file or leave its folder out") from e
        package = mod if mod in packages else mod[:-1]
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.Import):
                found = [(tuple(a.name.split(".")), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if node.level - 1 > len(package):
                        continue
                    base = package[: len(package) - (node.level - 1)]
                else:
                    base = ()
                base = base + (tuple(node.module.split(".")) if node.module else ())
                shown = "." * node.level + (node.module or "")
                for a in node.names:
                    # `from X import name`: the module X.name when there is one, else X
                    found.append((base + (a.name,) if base + (a.name,) in modules else base, f"from {shown} import {a.name}"))
            for dotted, what in found:
                target = target_of(dotted)
                if target is None or target == file:
                    continue
                theirs = by_file[target]
                if target in (modules.get(p) for p in packages) and mod[: len(theirs)] == theirs:
                    continue  # an enclosing package's __init__.py
                if file.endswith(("__init__.py", "__init__.pyi")) and theirs[: len(mod)] == mod:
                    continue  # a package's __init__ and its own modules
                edges.append(Edge(file, target, node.lineno, what))
    return edges, set(by_file)


# ---------------------------------------------------------------------------------------------
# Cycles
# ---------------------------------------------------------------------------------------------


def cycles(edges: list) -> list:
    """The strongly connected components of two or more files, each as (sorted files, the edges
    inside it), in a stable order."""
    graph: dict = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    comps: list = []
    counter = [0]

    def visit(v):  # iterative Tarjan
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in sorted(comps):
        members = set(comp)
        inside: dict = {}
        for e in edges:
            if e.src in members and e.dst in members:
                inside.setdefault((e.src, e.dst), e)  # the first import of each pair
        out.append((comp, sorted(inside.values(), key=lambda e: (e.src, e.dst))))
    return out


def scan(dirs: list) -> tuple:
    """(cycles, number of files read) over the given folders."""
    edges: list = []
    files: set = set()
    for d in dirs:
        if not os.path.isdir(d):
            raise InputError(f"{d}: no such folder; pass a Rust crate's src folder or a Python package folder")
        has_rs = has_py = False
        for _, dirnames, filenames in os.walk(d):
            dirnames[:] = [x for x in dirnames if x != "__pycache__"]
            has_rs |= any(f.endswith(".rs") for f in filenames)
            has_py |= any(f.endswith(".py") for f in filenames)
        if has_rs:
            if not _crate_roots(d):
                raise InputError(f"{d}: has .rs files but no crate root (lib.rs, main.rs or bin/*.rs); pass the crate's src folder")
            e, f = rust_edges(d)
            edges += e
            files |= f
        if has_py:
            e, f = python_edges(d)
            edges += e
            files |= f
        if not (has_rs or has_py):
            raise InputError(f"{d}: no .rs or .py files; pass a Rust crate's src folder or a Python package folder")
    return cycles(edges), len(files)


def _show(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def main(argv: list) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"import_cycles: unknown option {bad[0]} (it takes folders only; --help says more)", file=sys.stderr)
        return 2
    dirs = argv or [os.path.join(REPO, d) for d in DEFAULT_DIRS]
    try:
        found, nfiles = scan(dirs)
    except InputError as e:
        print(f"import_cycles: {e}", file=sys.stderr)
        return 2
    for k, (files, inside) in enumerate(found, 1):
        print(f"cycle {k}: {len(files)} files import each other in a loop")
        for f in files:
            print(f"  {_show(f)}")
        for e in inside:
            print(f"    {_show(e.src)}:{e.line} -> {_show(e.dst)}  ({e.what})")
    shown = ", ".join(_show(d) for d in dirs)
    if found:
        print(f"{len(found)} import cycle{'s' if len(found) > 1 else ''} in {nfiles} files ({shown})")
        return 1
    print(f"no import cycles in {nfiles} files ({shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
