"""Build Transformer Engine for a GPU machine that cannot reach a package index.

Responsible for producing, on a machine with network access and no GPU, a folder that makes
``import transformer_engine`` work on an offline machine with one GPU architecture, when put on
its ``PYTHONPATH``:

1. a Python venv of the target machine's Python version, with the torch it runs (its CUDA
   headers and libraries come from pip's ``cuda-toolkit`` wheels; no CUDA install is needed);
2. TE's torch extension, which PyPI publishes only as source, built against that torch (a plain
   C++ extension: about 10 minutes on 2 cores) and made to load torch's CUDA libraries itself
   (``patchelf --add-needed``: it uses c10::cuda and at::cuda symbols that nothing else loads);
3. TE's core library and its Python dependencies, as published wheels for the target;
4. the core library's device code for every other GPU architecture blanked (``prune_fatbin``):
   TE's core library is 276 MB as published, 35 MB compressed with sm_90 alone;
5. everything tarred and xz-compressed, with the megatron-core wheel beside it.

Each step is skipped when its output is already in ``--work``, so a rerun after a failure resumes.

Usage::

    python tools/te_offline_bundle.py --python /path/to/python3.12 --out .whl
    # on the GPU machine:
    mkdir -p /tmp/site && tar xJf .whl/te_site.tar.xz -C /tmp/site
    pip install --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
    PYTHONPATH=/tmp/site python -c "import transformer_engine"
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

_FATBIN_MAGIC = 0xBA55ED50
_PTX_KIND = 1
# Versions of TE's Python dependencies known to work together with TE 2.20.2 on Python 3.12.
_DEPENDENCIES = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
                 "nvdlfw-inspect==0.2.2", "nvidia-cudnn-frontend==1.32.0", "importlib-metadata==10.2.0"]
_CUDA_TOOLKIT_PARTS = "cccl,nvcc,crt,cudart,cublas,nvrtc,nvtx,cusparse,curand,cusolver"


def _elf_section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the named section of a 64-bit little-endian ELF image."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_offset = headers[shstrndx][4]
    for sh_name, _, _, _, offset, size in headers:
        end = data.index(b"\0", strtab_offset + sh_name)
        if data[strtab_offset + sh_name:end].decode() == name:
            return offset, size
    raise ValueError(f"no {name} section")


def prune_fatbin(path: Path, keep_arch: int) -> dict[str, int]:
    """Zero, in place, the device code in ``path``'s ``.nv_fatbin`` for architectures other than
    ``keep_arch`` (e.g. 90 for sm_90), keeping PTX of that architecture or older, which the driver
    can compile for it. Entry headers stay as they were, so the driver walks the containers as
    before and never picks a blanked payload. Returns bytes kept and blanked."""
    data = bytearray(path.read_bytes())
    start, size = _elf_section(data, ".nv_fatbin")
    end, p = start + size, start
    totals: dict[str, int] = collections.Counter()
    while p < end - 16:
        magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, p)
        if magic != _FATBIN_MAGIC:
            p += 8  # containers are 8-byte aligned
            continue
        q, stop = p + header_size, p + header_size + fat_size
        while q < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            body = q + entry_header
            keep = arch == keep_arch or (kind == _PTX_KIND and arch <= keep_arch)
            totals["kept" if keep else "blanked"] += payload
            if not keep:
                data[body:body + payload] = bytes(payload)
            q = body + payload
        if q != stop:
            raise ValueError(f"{path}: a fatbin container at {p:#x} does not end where its header says")
        p = stop
    path.write_bytes(data)
    return dict(totals)


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def _download_sdist(package: str, version: str, dest: Path) -> None:
    """Fetch ``package``'s source distribution through the package index's JSON simple API
    (PEP 691), checking its sha256; ``pip download`` cannot, because it builds metadata first."""
    name = package.lower().replace("_", "-")
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = f"{package}-{version}.tar.gz"
    found = [f for f in files if f["filename"] == wanted]
    if not found:
        raise SystemExit(f"error: the package index has no {wanted}; check --te-version")
    with urllib.request.urlopen(found[0]["url"], timeout=300) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != found[0]["hashes"]["sha256"]:
        raise SystemExit(f"error: {wanted} does not match the index's sha256")
    dest.write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True,
                        help="a Python of the GPU machine's version (e.g. 3.12) to build with")
    parser.add_argument("--out", default=".whl", help="where te_site.tar.xz and the megatron-core wheel go")
    parser.add_argument("--work", default="/tmp/te_bundle", help="build folder (kept, so a rerun resumes)")
    parser.add_argument("--te-version", default="2.20.2")
    parser.add_argument("--torch-version", default="2.11.0", help="the torch the GPU machine runs")
    parser.add_argument("--cuda-toolkit", default="13.0.2",
                        help="pip cuda-toolkit version matching that torch's CUDA (13.0.2 for torch 2.11.0)")
    parser.add_argument("--cuda-arch", type=int, default=90, help="the GPU's compute capability x 10 (90: H100)")
    parser.add_argument("--megatron-core-version", default="0.19.2")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args()
    if not shutil.which(args.python) and not Path(args.python).is_file():
        parser.error(f"--python {args.python}: not found; give the path of a Python of the GPU machine's version")
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    venv = work / "venv"
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    py_tag = subprocess.run([args.python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # Wheels for a glibc 2.28 machine: pip takes a --platform as that tag alone, not the older
    # manylinux tags it implies (pydantic-core's wheel is manylinux_2_17).
    target = ["--only-binary=:all:", "--python-version", py_tag]
    for minor in range(28, 16, -1):
        target += ["--platform", f"manylinux_2_{minor}_x86_64"]

    if not (venv / "bin" / "python").exists():
        _run([args.python, "-m", "venv", str(venv)])
        _run([*pip, "install", "-q", f"torch=={args.torch_version}", "setuptools<82", "wheel", "ninja", "pybind11",
              "packaging", "nvidia-cudnn-frontend", "patchelf",
              f"cuda-toolkit[{_CUDA_TOOLKIT_PARTS}]=={args.cuda_toolkit}"])

    built = work / "built"
    if not list(built.glob("transformer_engine_torch-*.whl")):
        source = work / f"transformer_engine_torch-{args.te_version}"
        if not source.exists():
            archive = work / "te_torch_sdist.tar.gz"
            _download_sdist("transformer_engine_torch", args.te_version, archive)
            with tarfile.open(archive) as tar:
                tar.extractall(work, filter="data")
        env = {**os.environ, "NVTE_PYTORCH_FORCE_BUILD": "TRUE", "NVTE_BUILD_USE_NVIDIA_WHEELS": "1",
               "NVTE_WITH_NCCL_EP": "0", "NVTE_CUDA_ARCHS": str(args.cuda_arch), "MAX_JOBS": str(args.jobs)}
        _run([*pip, "wheel", "--no-build-isolation", "--no-deps", "-w", str(built), "."], cwd=source, env=env)

    deps = work / "deps"
    if not list(deps.glob("transformer_engine_cu*.whl")):
        cuda_major = args.cuda_toolkit.split(".")[0]
        _run([*pip, "download", "-q", "--no-deps", *target, "-d", str(deps), f"transformer_engine=={args.te_version}",
              f"transformer_engine_cu{cuda_major}=={args.te_version}", *_DEPENDENCIES])

    site = work / "site"
    if not site.exists():
        staging = work / "site.partial"
        shutil.rmtree(staging, ignore_errors=True)
        wheels = [str(w) for w in sorted(deps.glob("*.whl")) + sorted(built.glob("*.whl"))]
        _run([*pip, "install", "-q", "--no-deps", "--no-compile", "--target", str(staging), *wheels])
        wheel_lib = staging / "transformer_engine" / "wheel_lib"
        extension, = wheel_lib.glob("transformer_engine_torch*.so")
        _run([str(venv / "bin" / "patchelf"), "--add-needed", "libc10_cuda.so", "--add-needed", "libtorch_cuda.so",
              str(extension)])
        pruned = prune_fatbin(wheel_lib / "libtransformer_engine.so", args.cuda_arch)
        print(f"device code of libtransformer_engine.so: {pruned.get('kept', 0) >> 20} MiB for sm_{args.cuda_arch} "
              f"kept, {pruned.get('blanked', 0) >> 20} MiB blanked", flush=True)
        staging.rename(site)

    bundle = out / "te_site.tar.xz"
    partial = bundle.with_suffix(".partial")
    with open(partial, "wb") as sink:
        tar = subprocess.Popen(["tar", "cf", "-", "-C", str(site), "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-6", "-T0"], stdin=tar.stdout, stdout=sink, check=True)
        if tar.wait():
            raise SystemExit("error: tar failed")
    partial.rename(bundle)
    _run([*pip, "download", "-q", "--no-deps", *target, "-d", str(out), f"megatron-core=={args.megatron_core_version}"])
    print(f"{bundle} ({bundle.stat().st_size >> 20} MiB) and the megatron-core wheel are in {out}")


if __name__ == "__main__":
    sys.exit(main())
