"""Build steps of kvd-client that pyproject.toml cannot say: generating

- the message classes (kvd_client/kvd_pb2.py and its .pyi stub) from kvd's
  proto/kvd.proto with the protoc of the pinned grpcio-tools, and
- the statistics' figures (kvd_client/_stats.py: a frozen dataclass per table,
  each line a typed field with its help text as its doc comment) from the
  tables of clients/c/kvd_stats_fields.h, which the daemon, the C client,
  kvcli and the Prometheus text expand too.

Where each source is found, first match wins:

1. next to this file, ``proto/kvd.proto`` and ``c/kvd_stats_fields.h``: an
   sdist (``python -m build``) carries copies there, made by the sdist command
   below;
2. ``../../proto/kvd.proto`` and ``../c/kvd_stats_fields.h``: the kvd
   repository this directory lives in (``pip install ./clients/python`` builds
   in place, so these resolve).

Neither there, or a table line the parser below cannot read: the build stops
with a message saying so. The paths are taken from this file's real location,
never from the current directory.
"""

from __future__ import annotations

import keyword
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import NamedTuple

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PACKAGE = "kvd_client"
PROTO_NAME = "kvd.proto"
PROTO_CANDIDATES = (
    HERE / "proto" / PROTO_NAME,               # inside an sdist
    HERE.parent.parent / "proto" / PROTO_NAME,  # inside a kvd checkout
)
STATS_HEADER_NAME = "kvd_stats_fields.h"
STATS_HEADER_CANDIDATES = (
    HERE / "c" / STATS_HEADER_NAME,         # inside an sdist
    HERE.parent / "c" / STATS_HEADER_NAME,  # inside a kvd checkout (clients/c)
)
STATS_MODULE = "_stats.py"
GENERATED = ("kvd_pb2.py", "kvd_pb2.pyi", STATS_MODULE)


def _find(name: str, candidates: tuple[Path, ...], what: str) -> Path:
    """The first of candidates that exists; exits with a clear message when none does."""
    for p in candidates:
        if p.is_file():
            return p
    tried = "\n  ".join(str(p) for p in candidates)
    sys.exit(
        f"kvd-client: cannot find {name}, which {what} generated from.\n"
        f"Looked at:\n  {tried}\n"
        "Build from a kvd checkout (pip install ./clients/python, with pip >= 21.3, which "
        "builds in place) or from an sdist made there (python -m build clients/python)."
    )


def find_proto() -> Path:
    """The kvd.proto to generate from; exits with a clear message when none exists."""
    return _find(PROTO_NAME, PROTO_CANDIDATES, "the message classes are")


def find_stats_header() -> Path:
    """The kvd_stats_fields.h to generate from; exits with a clear message when none exists."""
    return _find(STATS_HEADER_NAME, STATS_HEADER_CANDIDATES, "the statistics' classes are")


# ---- the statistics' tables (kvd_stats_fields.h) -> kvd_client/_stats.py ----------------

#: the Python type of each C type of a table line (STR<n>: a char[n], any n)
PY_TYPES = {"U64": "int", "U32": "int", "I32": "int", "BOOL": "bool"}
PY_DEFAULTS = {"int": "0", "bool": "False", "str": '""'}
PROM_TYPES = ("COUNTER", "GAUGE", "NONE")
#: the tables the package needs (results.py builds Stats and its rows on them)
STATS_TABLES = ("KVD_STATS_FIELDS", "KVD_WORKER_STATS_FIELDS", "KVD_HOST_STATS_FIELDS",
                "KVD_TENANT_STATS_FIELDS")
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11,
                   "\\": 92, "'": 39, '"': 34, "?": 63}


class StatsField(NamedTuple):
    """One line of a table: X(name, type, prom_type, prom_name, help)."""

    name: str
    type: str        # U64, U32, I32, BOOL or STR<n>
    prom_type: str   # COUNTER, GAUGE or NONE
    prom_name: str
    help: str
    line: int        # where it starts in the header, 1-based

    @property
    def py_type(self) -> str:
        return "str" if self.type.startswith("STR") else PY_TYPES[self.type]


class HeaderError(ValueError):
    """A line of kvd_stats_fields.h that the parser cannot read."""


class _Cursor:
    """Reads one table (a #define's body, its backslash-newlines spliced away
    and its comments blanked) token by token, knowing each character's line in
    the header."""

    def __init__(self, path: str, table: str, text: str, lines: list[int], pos: int, end: int):
        self.path, self.table, self.text, self.lines = path, table, text, lines
        self.pos, self.end = pos, end

    def fail(self, want: str) -> HeaderError:
        at = self.text[self.pos:min(self.end, self.pos + 40)]
        line = self.lines[min(self.pos, len(self.lines) - 1)]
        found = repr(at) if at else "the end of the table"
        return HeaderError(f"{self.path}:{line}: cannot read a line of {self.table}: expected "
                           f"{want}, found {found} (a line is X(name, type, prom_type, prom_name, "
                           "help), the last two C string literals)")

    def skip_space(self) -> None:
        while self.pos < self.end and self.text[self.pos].isspace():
            self.pos += 1

    def at_end(self) -> bool:
        self.skip_space()
        return self.pos >= self.end

    def ident(self, want: str) -> str:
        self.skip_space()
        m = re.compile(r"[A-Za-z_]\w*").match(self.text, self.pos, self.end)
        if not m:
            raise self.fail(want)
        self.pos = m.end()
        return m.group()

    def punct(self, c: str) -> None:
        self.skip_space()
        if not self.text.startswith(c, self.pos) or self.pos >= self.end:
            raise self.fail(repr(c))
        self.pos += 1

    def string(self, want: str) -> str:
        """One or more adjacent C string literals, concatenated and decoded
        (simple, octal and hex escapes; the bytes must be UTF-8)."""
        self.skip_space()
        if not self.text.startswith('"', self.pos):
            raise self.fail(want)
        out = bytearray()
        while self.text.startswith('"', self.pos) and self.pos < self.end:
            self.pos += 1
            while True:
                if self.pos >= self.end or self.text[self.pos] == "\n":
                    raise self.fail("the closing quote of a string literal")
                c = self.text[self.pos]
                if c == '"':
                    self.pos += 1
                    break
                if c != "\\":
                    out += c.encode()
                    self.pos += 1
                    continue
                e = self.text[self.pos + 1:self.pos + 2]
                if e in _SIMPLE_ESCAPES:
                    out.append(_SIMPLE_ESCAPES[e])
                    self.pos += 2
                elif m := (re.compile(r"([0-7]{1,3})").match(self.text, self.pos + 1, self.end)
                           or re.compile(r"x([0-9A-Fa-f]+)").match(self.text, self.pos + 1,
                                                                   self.end)):
                    # as in C: up to three octal digits, or every hex digit that follows
                    value = int(m.group(1), 8 if m.group().isdigit() else 16)
                    if value > 0xFF:
                        raise self.fail("an escape of one byte (at most \\377 or \\xff)")
                    out.append(value)
                    self.pos = m.end()
                else:
                    raise self.fail("a C escape sequence (\\\" \\\\ \\n \\ooo \\xhh ...)")
            self.skip_space()
        try:
            return out.decode()
        except UnicodeDecodeError:
            raise self.fail("a string literal whose bytes are UTF-8") from None


def _splice(text: str) -> tuple[str, list[int]]:
    """text with its backslash-newlines removed (C's line splicing, before
    anything else), and the header line of each character left."""
    out: list[str] = []
    lines: list[int] = []
    line, i = 1, 0
    while i < len(text):
        if text[i] == "\\":
            nl = 2 if text.startswith("\n", i + 1) else 3 if text.startswith("\r\n", i + 1) else 0
            if nl:
                i += nl
                line += 1
                continue
        out.append(text[i])
        lines.append(line)
        if text[i] == "\n":
            line += 1
        i += 1
    return "".join(out), lines


def _blank_comments(text: str, lines: list[int], path: str) -> str:
    """text with each comment's characters but its newlines made spaces (string
    and character literals read past, so that a "/*" in one is no comment)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            close = text.find("*/", i + 2)
            if close < 0:
                raise HeaderError(f"{path}:{lines[i]}: a /* comment that does not end")
            for j in range(i, close + 2):
                if out[j] != "\n":
                    out[j] = " "
            i = close + 2
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                out[i] = " "
                i += 1
        elif c in "\"'":
            i += 1
            while i < n and text[i] not in (c, "\n"):
                i += 2 if text[i] == "\\" else 1
            i += 1
        else:
            i += 1
    return "".join(out)


def parse_stats_fields(text: str, path: str = STATS_HEADER_NAME) -> dict[str, list[StatsField]]:
    """The tables of kvd_stats_fields.h (the text of it; path names it in
    messages): each ``#define KVD_..._FIELDS(X)`` by its name, its lines in
    order. Raises HeaderError, saying where, for anything in a table that is
    not a line it can read, a type, Prometheus type or name it does not know,
    or anything outside comments and preprocessor lines (such as a table line
    cut off from its #define by a missing backslash)."""
    spliced, lines = _splice(text)
    spliced = _blank_comments(spliced, lines, path)
    at = 0
    for logical in spliced.split("\n"):
        if logical.strip() and not logical.lstrip().startswith("#"):
            raise HeaderError(f"{path}:{lines[at]}: expected a comment or a preprocessor line, "
                              f"found {logical.strip()[:40]!r} (a table line whose line above "
                              "lacks its backslash?)")
        at += len(logical) + 1
    tables: dict[str, list[StatsField]] = {}
    define = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(KVD_\w*FIELDS)\(([A-Za-z_]\w*)\)", re.M)
    for m in define.finditer(spliced):
        table, x = m.group(1), m.group(2)
        end = spliced.find("\n", m.end())
        cur = _Cursor(path, table, spliced, lines, m.end(), len(spliced) if end < 0 else end)
        fields: list[StatsField] = []
        while not cur.at_end():
            line = lines[cur.pos]
            head = cur.ident(f"{x}(")
            if head != x:
                cur.pos -= len(head)
                raise cur.fail(f"{x}(")
            cur.punct("(")
            start = cur.pos
            name = cur.ident("the field's name")
            cur.punct(",")
            ctype = cur.ident("its type")
            if ctype not in PY_TYPES and not re.fullmatch(r"STR[1-9]\d*", ctype):
                cur.pos -= len(ctype)
                raise cur.fail(f"a type of {', '.join(PY_TYPES)} or STR<n>")
            cur.punct(",")
            prom_type = cur.ident("its Prometheus type")
            if prom_type not in PROM_TYPES:
                cur.pos -= len(prom_type)
                raise cur.fail(f"a Prometheus type of {', '.join(PROM_TYPES)}")
            cur.punct(",")
            prom_name = cur.string("its Prometheus name (a string literal)")
            cur.punct(",")
            at_help = cur.pos
            help_text = cur.string("its help (a string literal)")
            if not " ".join(help_text.split()).isprintable():
                cur.pos = at_help
                raise cur.fail("a help text of printable characters")
            cur.punct(")")
            if keyword.iskeyword(name) or any(f.name == name for f in fields):
                cur.pos = start
                raise cur.fail(f"a name that is not a Python keyword nor taken in {table} "
                               f"({name!r} is)")
            fields.append(StatsField(name, ctype, prom_type, prom_name, help_text, line))
        if not fields:
            raise cur.fail(f"at least one {x}(...) line")
        if table in tables:
            raise HeaderError(f"{path}:{lines[m.start()]}: {table} is defined twice")
        tables[table] = fields
    missing = [t for t in STATS_TABLES if t not in tables]
    if missing:
        raise HeaderError(f"{path}: no table {', '.join(missing)} (#define {missing[0]}(X) ...)")
    return tables


def stats_class_name(table: str) -> str:
    """KVD_WORKER_STATS_FIELDS -> WorkerStatsFields."""
    return "".join(w.capitalize() for w in table.removeprefix("KVD_").split("_"))


def stats_module(tables: dict[str, list[StatsField]]) -> str:
    """The source of kvd_client/_stats.py: a frozen dataclass per table, its
    lines as fields in order, each of its Python type with that type's zero as
    default and its help as its doc comment."""
    out = [
        f"# Generated from {STATS_HEADER_NAME} by clients/python/setup.py when the package is",
        "# built; do not edit: a figure is a line of that header's tables.",
        '"""The scalar figures of kvd\'s statistics, a dataclass per table of',
        "clients/c/kvd_stats_fields.h (the field order is the table's). results.py's",
        'Stats, WorkerStats, HostStats and TenantStats add the rest to them."""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        "",
        "__all__ = [" + ", ".join(f'"{stats_class_name(t)}"' for t in tables) + "]",
    ]
    for table, fields in tables.items():
        out += ["", "", "@dataclass(frozen=True)", f"class {stats_class_name(table)}:",
                f'    """The figures of {table}, in its order."""', ""]
        for f in fields:
            help_text = " ".join(f.help.split())
            if help_text:
                out += textwrap.wrap(help_text, width=99, initial_indent="    #: ",
                                     subsequent_indent="    #: ", break_long_words=False,
                                     break_on_hyphens=False)
            out.append(f"    {f.name}: {f.py_type} = {PY_DEFAULTS[f.py_type]}")
    return "\n".join(out) + "\n"


def generate_stats(out_root: Path) -> Path:
    """Writes out_root/kvd_client/_stats.py from kvd_stats_fields.h; exits
    with the parser's message on a line it cannot read. Returns the file."""
    header = find_stats_header()
    try:
        tables = parse_stats_fields(header.read_text(encoding="utf-8"), str(header))
    except (HeaderError, UnicodeDecodeError) as e:
        sys.exit(f"kvd-client: cannot generate {PACKAGE}/{STATS_MODULE}: {e}")
    dst = out_root / PACKAGE / STATS_MODULE
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(stats_module(tables), encoding="utf-8")
    return dst


# ---- kvd.proto -> kvd_client/kvd_pb2.py, .pyi -----------------------------------------------


def generate_messages(out_root: Path) -> list[Path]:
    """Runs protoc on kvd.proto, writing kvd_pb2.py and kvd_pb2.pyi into
    out_root/kvd_client/. Returns the files written.

    The .proto is staged as kvd_client/kvd.proto, so the descriptor registered
    in protobuf's default pool is named "kvd_client/kvd.proto" and cannot clash
    with some other package's "kvd.proto"."""
    proto = find_proto()
    with tempfile.TemporaryDirectory(prefix="kvd-proto-") as tmp:
        staged = Path(tmp) / PACKAGE / PROTO_NAME
        staged.parent.mkdir()
        shutil.copyfile(proto, staged)
        (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"--proto_path={tmp}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"{PACKAGE}/{PROTO_NAME}",
        ]
        try:
            subprocess.run(cmd, check=True, cwd=tmp)
        except FileNotFoundError as e:  # pragma: no cover - no interpreter?
            sys.exit(f"kvd-client: cannot run protoc: {e}")
        except subprocess.CalledProcessError as e:
            sys.exit(
                f"kvd-client: protoc failed (exit {e.returncode}) on {proto}; "
                "is grpcio-tools installed (a build requirement)?"
            )
    written = [out_root / PACKAGE / name for name in GENERATED if name.startswith("kvd_pb2")]
    for p in written:
        if not p.is_file():
            sys.exit(f"kvd-client: protoc did not write {p}")
    return written


def generate(out_root: Path) -> list[Path]:
    """Generates every module of GENERATED into out_root/kvd_client/; returns them."""
    return [*generate_messages(out_root), generate_stats(out_root)]


class BuildPyWithProto(build_py):
    """build_py that also generates the message classes and the statistics'
    figures into the build tree (into the source tree for an editable install)."""

    def run(self) -> None:
        if not self.editable_mode:
            # an in-place build reuses build/: start the package afresh there,
            # so that no module removed from the source lingers in the wheel
            shutil.rmtree(Path(self.build_lib) / PACKAGE, ignore_errors=True)
        super().run()
        out = HERE if self.editable_mode else Path(self.build_lib).resolve()
        self._generated = generate(out)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outs = list(super().get_outputs(include_bytecode))
        for name in GENERATED:
            p = str(Path(self.build_lib) / PACKAGE / name)
            if p not in outs:
                outs.append(p)
        return outs


class SdistWithProto(sdist):
    """sdist that carries kvd.proto (as proto/kvd.proto) and kvd_stats_fields.h
    (as c/kvd_stats_fields.h), so that a wheel can be built from the sdist away
    from the kvd checkout."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        for src, rel in ((find_proto(), Path("proto") / PROTO_NAME),
                         (find_stats_header(), Path("c") / STATS_HEADER_NAME)):
            dst = Path(base_dir) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


# setuptools runs this file as __main__; tests/python/test_package.py imports
# it under another name for the header's parser, building nothing
if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto})
