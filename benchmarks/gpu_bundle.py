"""Packs TensorFlow for a GPU machine that has no TensorFlow and takes 64 MiB per call.

    python benchmarks/gpu_bundle.py --out=/tmp/gpu      # /tmp/gpu/parts/part00 ...; prints the plan
    python benchmarks/gpu_bundle.py --plan-only --bundle-mb=615   # the plan alone, nothing built

The `device` machines of this workplace (one H200 or H100, Python 3.12, CUDA 13 libraries, no
TensorFlow, no network) take the working tree plus the carried files, 64 MiB in all, per
call. TensorFlow 2.21's wheel alone is 573 MB, and it needs CUDA 12 libraries (cuBLAS 12 is
581 MB more). This script builds what one run needs, as about 615 MB of zstd (level 12)
split in parts that fit a call beside the working tree:

- TensorFlow 2.21 (cp312) and its pure-Python needs, as pip would unpack them; the C++
  headers and the unused StableHLO extension left out;
- the GPU kernels for every architecture but sm_90 zeroed in place (libtensorflow_cc,
  libtensorflow_framework, cuBLAS 12): the fat binaries keep their layout, so the driver
  still finds the sm_90 code and the PTX, and zeros compress to nothing;
- cuBLAS 12 and the CUDA 12 runtime (real), cuDNN 9's loader library (TensorFlow loads
  cuDNN's parts only when a convolution runs), and empty stand-ins for cuFFT, cuSOLVER,
  cuSPARSE and cuRAND: TensorFlow opens them at start and registers no GPU if one is
  missing, but a transformer's step never calls them (an FFT or a linear solve would fail);
- ptxas and libdevice for XLA; a zstd binary for the far side.

What a call needs: every part of benchmarks/gpu_check.sh, its default call included, imports
TensorFlow and runs cuBLAS, so it needs the whole bundle; nothing of it can be left out for
a smaller first call. The number of uploads is the bundle over the part size, and the part
size is what the working tree leaves of a call's 64 MiB: `--part-mib` defaults to
64 - (tracked and untracked-not-ignored files, as `git ls-files` lists them) - 2 MiB. The
first H200 run (2026-12-04) took 11 parts of 54 MiB beside an 8 MiB tree; with the tree at
17 MiB (2026-12) parts are 44 MiB and the same bundle needs 14. `--level=19` makes it about
10% smaller (measured here on 200 MB of the zeroed TensorFlow libraries: 33.5 MB against
37.0 MB at level 12), one or two parts fewer, for 12 times the compression time (183 s
against 15 s for those 200 MB on 2 shared cores). The last upload call unpacks and runs the
default check too, so the uploads add no call of their own:

    (calls 1 .. N-1, carry [".gpu"]): mkdir -p /tmp/acc && cp .gpu/* /tmp/acc/
    (call N, carry [".gpu"]): cp .gpu/* /tmp/acc/ && cat /tmp/acc/part* | LD_LIBRARY_PATH=/tmp/acc \
        /tmp/acc/zstd -d --long=27 | tar -x -C /tmp/site && SITE=/tmp/site OUT=$OUT bash benchmarks/gpu_check.sh

with .gpu holding one part each time (and the zstd binary and its libraries in the first).
The first run's upload calls took about 5 s of device time each, the unpacking about 10 s.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import struct
import subprocess
import sys
import zipfile

FATBIN_MAGIC = 0xBA55ED50
KEEP_ARCH = 90  # the H100/H200's sm_90 (and its PTX)
WHEELS = ("tensorflow==2.21.0", "keras==3.15.1", "ml_collections==1.1.0", "optree==0.20.0",
          "namex==0.1.0", "gast==0.7.0", "astunparse==1.6.3", "google-pasta==0.2.0",
          "termcolor==3.3.0", "protobuf==7.36.2", "ml_dtypes==0.7.0", "numpy==2.4.6",
          "opt_einsum==3.4.0", "flatbuffers==25.12.19", "wrapt==2.5.2")
CUDA_WHEELS = ("nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cuda-nvcc-cu12==12.9.86",
               "nvidia-cublas-cu12==12.9.3.13", "nvidia-cudnn-cu12==9.3.0.75")
STAND_INS = ("libcufft.so.11", "libcusolver.so.11", "libcusparse.so.12", "libcurand.so.10")


def zero_other_architectures(path: str, keep: int = KEEP_ARCH) -> dict[tuple[int, int], int]:
    """Zeroes, in place, every entry of the `.nv_fatbin` section not built for `keep`.

    Returns bytes per (kind, arch) found; kind 1 is PTX, 2 is machine code (ELF).
    """
    sections = subprocess.check_output(["readelf", "-S", "-W", path], text=True)
    line = next(s for s in sections.splitlines() if ".nv_fatbin" in s)
    fields = line.split("]", 1)[1].split()
    start, size = int(fields[3], 16), int(fields[4], 16)
    found: dict[tuple[int, int], int] = {}
    untouched = 0  # fat binaries with nothing for `keep`: left whole, their PTX may JIT
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        position, end = start, start + size
        while position < end:
            magic, _, header, body = struct.unpack_from("<IHHQ", m, position)
            if magic != FATBIN_MAGIC:  # padding between fat binaries
                position += 8
                continue
            entries, entry, last = [], position + header, position + header + body
            while entry < last:
                kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", m, entry)
                arch = struct.unpack_from("<I", m, entry + 28)[0]
                found[(kind, arch)] = found.get((kind, arch), 0) + entry_size
                entries.append((arch, entry + entry_header, entry_size))
                entry += entry_header + entry_size
            if any(arch == keep for arch, _, _ in entries):
                for arch, payload, entry_size in entries:
                    if arch != keep:
                        m[payload:payload + entry_size] = bytes(entry_size)
            else:
                untouched += 1
            position = last
        m.flush()
    if untouched:
        print(f"{path}: {untouched} fat binaries without sm_{keep} code left whole")
    return found


def download(wheels, folder: str) -> None:
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                             "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                             "manylinux_2_12_x86_64", "manylinux2010_x86_64")]
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "--python-version=3.12", "--implementation=cp",
                           *platforms, "-d", folder, *wheels])


def extract(wheel: str, member: str, to: str) -> None:
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(to, "wb") as dst:
        shutil.copyfileobj(src, dst)


def build(out: str, part_mib: int, level: int = 12) -> str:
    """Downloads, trims, packs and splits; returns the bundle's path."""
    wheels, site = os.path.join(out, "wheels"), os.path.join(out, "site")
    shutil.rmtree(site, ignore_errors=True)
    download(WHEELS + CUDA_WHEELS, wheels)
    named = {w.split("-")[0].lower(): os.path.join(wheels, w) for w in os.listdir(wheels)}
    for name, wheel in named.items():
        if not name.startswith("nvidia"):
            zipfile.ZipFile(wheel).extractall(site)
    shutil.rmtree(os.path.join(site, "tensorflow", "include"))
    os.remove(os.path.join(site, "tensorflow", "compiler", "mlir", "stablehlo", "stablehlo_extension.so"))
    cuda = os.path.join(site, "cuda")
    for folder in ("lib", "bin", os.path.join("nvvm", "libdevice")):
        os.makedirs(os.path.join(cuda, folder), exist_ok=True)
    for wheel, member, to in (
            ("nvidia_cuda_runtime_cu12", "nvidia/cuda_runtime/lib/libcudart.so.12", "lib"),
            ("nvidia_cublas_cu12", "nvidia/cublas/lib/libcublas.so.12", "lib"),
            ("nvidia_cublas_cu12", "nvidia/cublas/lib/libcublasLt.so.12", "lib"),
            ("nvidia_cudnn_cu12", "nvidia/cudnn/lib/libcudnn.so.9", "lib"),
            ("nvidia_cuda_nvcc_cu12", "nvidia/cuda_nvcc/bin/ptxas", "bin"),
            ("nvidia_cuda_nvcc_cu12", "nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc", "nvvm/libdevice")):
        extract(named[wheel], member, os.path.join(cuda, to, os.path.basename(member)))
    os.chmod(os.path.join(cuda, "bin", "ptxas"), 0o755)
    source = os.path.join(out, "empty.c")
    with open(source, "w") as f:
        f.write("int tfpar_stand_in(void) { return 0; }\n")
    for name in STAND_INS:
        subprocess.check_call(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o",
                               os.path.join(cuda, "lib", name), source])
    for path in ("tensorflow/libtensorflow_cc.so.2", "tensorflow/libtensorflow_framework.so.2",
                 "cuda/lib/libcublas.so.12", "cuda/lib/libcublasLt.so.12"):
        found = zero_other_architectures(os.path.join(site, path))
        kept = sum(v for (_, arch), v in found.items() if arch == KEEP_ARCH)
        print(f"{path}: kept {kept / 1e6:.0f} MB of sm_{KEEP_ARCH}, zeroed "
              f"{(sum(found.values()) - kept) / 1e6:.0f} MB of other architectures")
    bundle, parts = os.path.join(out, "bundle.tar.zst"), os.path.join(out, "parts")
    subprocess.check_call(["bash", "-o", "pipefail", "-c",
                           f"tar -C '{site}' -cf - . | zstd -T2 -{level} --long=27 -q -f -o '{bundle}'"])
    shutil.rmtree(parts, ignore_errors=True)
    os.makedirs(parts)
    subprocess.check_call(["split", "-b", f"{part_mib}M", "-d", "-a", "2", bundle, os.path.join(parts, "part")])
    zstd = shutil.which("zstd")
    shutil.copy(zstd, parts)  # and the libraries it links, but the C library
    for line in subprocess.check_output(["ldd", zstd], text=True).splitlines():
        library = line.split("=>")[-1].split("(")[0].strip()
        if os.path.isabs(library) and not os.path.basename(library).startswith(("libc.", "ld-linux")):
            shutil.copy(library, parts)
    count = sum(name.startswith("part") for name in os.listdir(parts))
    print(f"{bundle}: {os.path.getsize(bundle) / 1e6:.0f} MB in {count} parts under {parts}")
    return bundle


CALL_MIB = 64  # what one device call carries: the working tree and the carried parts
MARGIN_MIB = 2


def tree_mib(repo: str = ".") -> float:
    """MiB of the working tree a device call sends: tracked and untracked-not-ignored files."""
    listed = subprocess.check_output(["git", "-C", repo, "ls-files", "-z", "--cached", "--others",
                                      "--exclude-standard"])
    paths = (os.path.join(repo, p) for p in listed.decode().split("\0") if p)
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) / 2**20


def part_mib_for(tree: float) -> int:
    """The largest part that travels beside a working tree of `tree` MiB.

    Example:
        >>> part_mib_for(17.4)
        44
    """
    return int(CALL_MIB - tree - MARGIN_MIB)


def upload_plan(bundle_mb: float, part_mib: int, tree: float) -> str:
    """How many upload calls a bundle of `bundle_mb` MB takes, in words."""
    parts = -(-int(bundle_mb * 1e6) // (part_mib * 2**20))
    return (f"{bundle_mb:.0f} MB in {parts} parts of {part_mib} MiB: {parts} upload calls beside the "
            f"{tree:.1f} MiB working tree (the last one also unpacks and runs gpu_check.sh's "
            "default call); every part of the check needs the whole bundle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gpu")
    parser.add_argument("--part-mib", type=int, default=0,
                        help="part size; 0: what the working tree leaves of a call's 64 MiB")
    parser.add_argument("--level", type=int, default=12, help="zstd level (19: ~10%% smaller, 12x slower)")
    parser.add_argument("--plan-only", action="store_true", help="print the upload plan, build nothing")
    parser.add_argument("--bundle-mb", type=float, default=615.0,
                        help="--plan-only: the bundle's size (the first run's: 615 MB)")
    args = parser.parse_args()
    tree = tree_mib(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    part_mib = args.part_mib or part_mib_for(tree)
    if args.plan_only:
        print(upload_plan(args.bundle_mb, part_mib, tree))
        return
    bundle = build(args.out, part_mib, args.level)
    print(upload_plan(os.path.getsize(bundle) / 1e6, part_mib, tree))


if __name__ == "__main__":
    main()
