"""Build steps of kvd-client that pyproject.toml cannot say: generating the
message classes (kvd_client/kvd_pb2.py and its .pyi stub) from kvd's
proto/kvd.proto with the protoc of the pinned grpcio-tools.

Where the .proto is found, first match wins:

1. ``proto/kvd.proto`` next to this file: an sdist (``python -m build``) carries
   a copy there, made by the sdist command below;
2. ``../../proto/kvd.proto``: the kvd repository this directory lives in
   (``pip install ./clients/python`` builds in place, so this resolves).

Neither there: the build stops with a message saying so. The paths are taken
from this file's real location, never from the current directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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
GENERATED = ("kvd_pb2.py", "kvd_pb2.pyi")


def find_proto() -> Path:
    """The kvd.proto to generate from; exits with a clear message when none exists."""
    for p in PROTO_CANDIDATES:
        if p.is_file():
            return p
    tried = "\n  ".join(str(p) for p in PROTO_CANDIDATES)
    sys.exit(
        "kvd-client: cannot find kvd.proto, which the message classes are generated from.\n"
        f"Looked at:\n  {tried}\n"
        "Build from a kvd checkout (pip install ./clients/python, with pip >= 21.3, which "
        "builds in place) or from an sdist made there (python -m build clients/python)."
    )


def generate(out_root: Path) -> list[Path]:
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
    written = [out_root / PACKAGE / name for name in GENERATED]
    for p in written:
        if not p.is_file():
            sys.exit(f"kvd-client: protoc did not write {p}")
    return written


class BuildPyWithProto(build_py):
    """build_py that also generates the message classes into the build tree
    (into the source tree for an editable install)."""

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
    """sdist that carries kvd.proto (as proto/kvd.proto), so that a wheel can
    be built from the sdist away from the kvd checkout."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        dst = Path(base_dir) / "proto" / PROTO_NAME
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(find_proto(), dst)


setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto})
