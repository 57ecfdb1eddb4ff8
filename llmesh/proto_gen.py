"""Generates the Python stubs in llmesh/v1 from protos/llmesh/v1 (`make proto`).

The stubs are committed so IDEs and type checkers see them; tests/unit/test_proto_drift.py
regenerates into a temporary folder and fails when the committed files differ.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("llmesh") / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Runs protoc into out_root; returns the generated files (relative to out_root)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / PACKAGE_DIR).glob("*_pb2*.py*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        target = ROOT / PACKAGE_DIR
        for old in target.glob("*_pb2*.py*"):
            old.unlink()
        for rel in generated:
            (ROOT / rel).write_bytes((Path(tmp) / rel).read_bytes())
            print(f"wrote {rel}")
    (ROOT / PACKAGE_DIR / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
