"""Regenerate the Python gRPC modules from the ``.proto`` files in this package.

Usage (from the repository root)::

    python -m proto.generate

This rewrites ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` next to each
``.proto`` file. The generated modules import each other as
``proto.persys.<svc>.v1``, because protoc is run with the repository root as
its include path.
"""

from __future__ import annotations

import importlib.resources
import pathlib
import shutil
import sys

from grpc_tools import protoc

REPO_ROOT: pathlib.Path = pathlib.Path(__file__).resolve().parent.parent

PROTO_FILES: tuple[str, ...] = (
    "proto/persys/control/v1/control.proto",
    "proto/persys/agent/v1/agent.proto",
)


def _mypy_plugin() -> pathlib.Path:
    """Locate mypy-protobuf's ``protoc-gen-mypy`` (venv bin dir first, then PATH)."""
    name = "protoc-gen-mypy"
    candidate = pathlib.Path(sys.executable).parent / name
    if candidate.is_file():
        return candidate
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH")
    return pathlib.Path(found)


def _grpc_tools_include() -> pathlib.Path:
    """Directory holding google/protobuf/*.proto shipped with grpc_tools."""
    return pathlib.Path(str(importlib.resources.files("grpc_tools") / "_proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc on every file in PROTO_FILES, writing the outputs under *out_dir*."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = str(out_dir)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{_grpc_tools_include()}",
        f"--plugin=protoc-gen-mypy={_mypy_plugin()}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        *PROTO_FILES,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


def main() -> int:
    generate(REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
