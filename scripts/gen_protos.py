"""Regenerate cluster/v1/*_pb2*.py(i) from protos/cluster/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]

The generated code is checked in; tests/unit/test_protos_current.py runs this into a temporary
directory and fails when the result differs from what is committed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto under protos/ into out_dir; return the files written."""
    import grpc_tools  # noqa: PLC0415 - a dev dependency, needed only to regenerate
    from grpc_tools import protoc  # noqa: PLC0415

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in (out_dir / "cluster" / "v1").glob("*_pb2*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write cluster/v1/ under")
    args = parser.parse_args()
    written = generate(args.out)
    for path in written:
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
