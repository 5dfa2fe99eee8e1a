"""Regenerate (or check) the committed gRPC stubs from ``proto/ditserve/v1/ditserve.proto``.

    python -m ditserve.cluster.grpc_gen.build           # rewrite ditserve_pb2*.py
    python -m ditserve.cluster.grpc_gen.build --check   # exit 1 when they are out of date

protoc names imports after the proto's package path (``from ditserve.v1 import ditserve_pb2``), which
would clash with our own ``ditserve`` package; the import is rewritten to a relative one, and the
messages' module name (used by pickle) to the real one.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PROTO = "ditserve/v1/ditserve.proto"
OUTPUTS = ("ditserve_pb2.py", "ditserve_pb2.pyi", "ditserve_pb2_grpc.py")
# pyproject.toml's grpcio>= (the stubs call nothing newer)
GRPCIO_FLOOR = "1.66.0"


def generate() -> dict[str, str]:
    """Run protoc (grpcio-tools) into a temporary folder; returns {file name: text}."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto (Struct)
    with tempfile.TemporaryDirectory() as out:
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{well_known}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO_ROOT / PROTO),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        texts = {name: (Path(out) / "ditserve" / "v1" / name).read_text() for name in OUTPUTS}
    texts["ditserve_pb2_grpc.py"] = texts["ditserve_pb2_grpc.py"].replace(
        "from ditserve.v1 import ditserve_pb2", "from . import ditserve_pb2"
    )
    # Message classes record their module for pickling (Serve pickles requests to the replica).
    texts["ditserve_pb2.py"] = texts["ditserve_pb2.py"].replace("'ditserve.v1.ditserve_pb2'", "__name__")
    # The service stubs refuse a grpcio older than the grpcio-tools that wrote them; they hold the floor of
    # pyproject.toml instead, so the committed stubs (and --check) do not change with the tools' patch release.
    texts["ditserve_pb2_grpc.py"] = re.sub(
        r"^GRPC_GENERATED_VERSION = '[^']*'$",
        f"GRPC_GENERATED_VERSION = '{GRPCIO_FLOOR}'",
        texts["ditserve_pb2_grpc.py"],
        flags=re.M,
    )
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Fail when the committed stubs differ.")
    ns = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = HERE / name
        if ns.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run python -m ditserve.cluster.grpc_gen.build", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
