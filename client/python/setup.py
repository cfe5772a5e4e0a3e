"""Build hook of the kvmem package: the gRPC stubs are generated from proto/kvmem/v1/kvmem.proto
with grpcio-tools at build time, into kvmem/v1/, and are never committed.

Everything else (name, version, packages) is in pyproject.toml. The protobuf and grpcio
requirements are computed here: a stub needs a runtime at least as new as the protoc (and
grpc_tools) that generated it, so the wheel asks for at least those versions. The generator
is pinned (pyproject.toml) and named in the stubs' marker (_proto_source.GENERATOR).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import pathlib
import re
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "kvmem/v1/kvmem.proto"
# In the repository the proto is two folders up; an sdist carries its own copy (below).
PROTO_ROOTS = (HERE.parent.parent / "proto", HERE / "proto")
GENERATED = ("kvmem_pb2.py", "kvmem_pb2.pyi", "kvmem_pb2_grpc.py", "_proto_source.py")


def proto_root() -> pathlib.Path:
    for root in PROTO_ROOTS:
        if (root / PROTO_FILE).is_file():
            return root
    raise SystemExit(f"kvmem: {PROTO_FILE} not found under {' or '.join(map(str, PROTO_ROOTS))}")


def googleapis_root() -> pathlib.Path:
    """The folder holding google/rpc/status.proto: googleapis-common-protos ships the .proto
    files beside its generated modules."""
    import google.rpc.status_pb2 as status  # noqa: PLC0415 (a build requirement)

    root = pathlib.Path(status.__file__).resolve().parent.parent.parent
    if not (root / "google/rpc/status.proto").is_file():
        raise SystemExit(f"kvmem: google/rpc/status.proto not found under {root} "
                         "(googleapis-common-protos too old?)")
    return root


def generator() -> str:
    """The grpcio-tools version that generates the stubs (that of the build environment)."""
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError as e:
        raise SystemExit("kvmem: building needs grpcio-tools (pip install grpcio-tools)") from e


def generate_stubs() -> None:
    """Runs grpcio-tools' protoc on kvmem.proto; skipped when the stubs were generated from
    these very bytes by this very generator already (a build runs this hook several times)."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # building without isolation in an environment without it
        raise SystemExit("kvmem: building needs grpcio-tools (pip install grpcio-tools)") from e
    root = proto_root()
    digest = hashlib.sha256((root / PROTO_FILE).read_bytes()).hexdigest()
    made_by = f"grpcio-tools {generator()}"
    out = HERE / "kvmem" / "v1"
    marker = out / "_proto_source.py"
    if marker.is_file() and all(f'"{text}"' in marker.read_text()
                                for text in (digest, made_by)) and all(
            (out / name).is_file() for name in GENERATED):
        return
    includes = [root, googleapis_root(), pathlib.Path(grpc_tools.__file__).parent / "_proto"]
    args = ["grpc_tools.protoc", *(f"--proto_path={p}" for p in includes),
            f"--python_out={HERE}", f"--pyi_out={HERE}", f"--grpc_python_out={HERE}",
            str(root / PROTO_FILE)]
    if protoc.main(args) != 0:
        raise SystemExit(f"kvmem: protoc failed on {root / PROTO_FILE}")
    marker.write_text(
        '"""Generated at build time (setup.py): the kvmem.proto and generator of the stubs."""\n'
        f'PROTO_SHA256 = "{digest}"\n'
        f'GENERATOR = "{made_by}"\n')


def runtime_requirements() -> list[str]:
    """numpy, plus grpcio and protobuf no older than the versions the stubs were made by."""
    generate_stubs()
    out = HERE / "kvmem" / "v1"
    pb2 = (out / "kvmem_pb2.py").read_text()
    grpc_stub = (out / "kvmem_pb2_grpc.py").read_text()
    # protobuf >= 5 stubs call ValidateProtobufRuntimeVersion(domain, major, minor, patch, ...)
    # and refuse an older runtime; older ones name their version in a comment.
    gencode = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+)",
                        pb2) or re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", pb2)
    if gencode:
        protobuf = "protobuf>={}.{}.{}".format(*gencode.groups())
    else:
        import google.protobuf  # noqa: PLC0415 (no version named: match the build's runtime)
        protobuf = f"protobuf>={'.'.join(google.protobuf.__version__.split('.')[:2])}"
    # grpcio >= 1.63 stubs name GRPC_GENERATED_VERSION and refuse an older grpcio; older ones
    # need the grpcio of their generator's line.
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub)
    floor = grpc_version.group(1) if grpc_version else \
        ".".join(generator().split(".")[:2])
    return ["numpy>=1.22", f"grpcio>={floor}", protobuf, "googleapis-common-protos>=1.63,<2"]


class BuildPyWithStubs(build_py):
    """build_py that generates the stubs first, so that they are copied into the wheel."""

    def run(self) -> None:
        generate_stubs()
        super().run()


class SdistWithProto(sdist):
    """An sdist carries the proto (its build cannot reach the repository's proto/)."""

    def run(self) -> None:
        source = PROTO_ROOTS[0] / PROTO_FILE
        if source.is_file():
            target = HERE / "proto" / PROTO_FILE
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        super().run()


setup(install_requires=runtime_requirements(),
      cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto})
