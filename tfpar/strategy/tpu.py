"""Find and initialise a TPU: a TPU VM (Colab, Kaggle, Cloud), a named TPU or pod slice.

A TPU is there when this host's PCI bus has a Google (vendor 0x1ae0) device with a TPU
device id, when the TPU driver's /dev/accelN nodes exist, or when the TPU VM's TPU_*
variables are set. Not from /dev/accel/ alone: Linux's accel subsystem creates that folder
for other NPUs too, and 0x1ae0 alone is also Google's virtual NIC on every GCE VM.

A pod slice spans several hosts: `tpu="local"` there would only see this host's chips (one
unsynchronised training per host), so a named TPU (tpu=NAME or TPU_NAME) comes first and
`local` is refused on a multi-host slice, before and after initialising.

Example:
    >>> resolver = connect_tpu()          # raises TPUNotFoundError listing what it tried
    >>> strategy = tf.distribute.TPUStrategy(resolver)
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Mapping

from absl import logging

from tfpar.errors import TPUNotFoundError, TPUSliceError

GOOGLE_PCI_VENDOR = "0x1ae0"
# Google PCI device ids of TPU chips (as JAX's hardware_utils lists them). 0x1ae0 also
# names Google's virtual NIC (gVNIC), so the vendor alone is not a TPU.
TPU_PCI_DEVICES = {"0x0027": "v2/v3", "0x0056": "v4 lite", "0x005e": "v4", "0x0062": "v5p",
                   "0x0063": "v5e", "0x006f": "v6e"}
TPU_VM_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES")
# tfpar is not on PyPI: the TPU extra installs from the clone. `-f` adds Google's libtpu
# builds for TensorFlow to what pip may pick (Colab's instruction, googlecolab/colabtools#5164).
LIBTPU_INDEX = "https://storage.googleapis.com/libtpu-tf-releases/index.html"
INSTALL_TPU = f'pip install -e ".[tpu]" -f {LIBTPU_INDEX}'  # run in the clone; docs/tpu.md
# Accelerator types whose number counts TensorCores (2 per chip); the others count chips.
_TWO_CORES_PER_CHIP = ("v2", "v3", "v4", "v5p")

_connected = {"hosts": 0}  # hosts of the TPU this process initialised (0: none)


@dataclasses.dataclass(frozen=True)
class LocalTPU:
    """What this host shows of a TPU. `root` replaces '/' (tests use a fake tree)."""

    chips: int                # TPU chips on this host's PCI bus
    device_nodes: tuple       # /dev/accelN (TPU v2-v4 driver) and, with TPU chips, /dev/vfio/N
    variables: tuple          # TPU VM variables that are set

    @property
    def found(self) -> bool:
        return bool(self.chips or self.device_nodes or self.variables)


def local_tpu(root: str = "/", environ: Mapping[str, str] | None = None) -> LocalTPU:
    """Looks at this host's PCI devices, /dev nodes and TPU VM variables (no TensorFlow)."""
    environ = os.environ if environ is None else environ
    chips = 0
    for folder in glob.glob(os.path.join(root, "sys/bus/pci/devices/*")):
        if (_read(os.path.join(folder, "vendor")) == GOOGLE_PCI_VENDOR
                and _read(os.path.join(folder, "device")) in TPU_PCI_DEVICES):
            chips += 1
    nodes = [p for p in glob.glob(os.path.join(root, "dev/accel[0-9]*")) if not os.path.isdir(p)]
    if chips:
        nodes += glob.glob(os.path.join(root, "dev/vfio/[0-9]*"))
    variables = tuple(v for v in TPU_VM_VARIABLES if environ.get(v))
    return LocalTPU(chips, tuple(sorted(nodes)), variables)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip().lower()
    except OSError:
        return ""


def slice_chips(accelerator_type: str) -> int | None:
    """Chips in a slice from its accelerator type: 'v4-32' -> 16, 'v5litepod-16' -> 16."""
    match = re.fullmatch(r"(v\d+[a-z]*?)(?:litepod|lite|pod)?-(\d+)", accelerator_type.strip().lower())
    if not match:
        return None
    generation, number = match.group(1), int(match.group(2))
    return number // 2 if generation in _TWO_CORES_PER_CHIP else number


def slice_hosts(environ: Mapping[str, str] | None = None, root: str = "/") -> int:
    """Hosts of this TPU slice: from the TPU tfpar initialised, else from this host's view
    (TPU_WORKER_HOSTNAMES, or the slice's chips over the chips this host sees); 1 if unknown."""
    if _connected["hosts"]:
        return _connected["hosts"]
    environ = os.environ if environ is None else environ
    names = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(names) > 1:
        return len(names)
    chips = slice_chips(environ.get("TPU_ACCELERATOR_TYPE", ""))
    here = local_tpu(root, environ).chips
    if chips and here and chips > here:
        return -(-chips // here)
    return 1


def tpu_candidates(tpu: str | None = None, environ: Mapping[str, str] | None = None,
                   root: str = "/") -> list[tuple[str, str]]:
    """Where a TPU could be, best first, as (tpu argument for the resolver, why).

    Empty when nothing on this machine points at a TPU, so `auto` never probes blindly
    (a probe without a TPU can wait on the network for minutes).
    """
    environ = os.environ if environ is None else environ
    if tpu:
        return [(tpu, f"tpu={tpu!r} was given")]
    found = []
    if environ.get("TPU_NAME"):
        found.append((environ["TPU_NAME"], "TPU_NAME is set (a named TPU: every host of its slice)"))
    here = local_tpu(root, environ)
    if here.found:
        found.append(("local", f"this is a TPU VM ({_evidence(here)})"))
    if environ.get("COLAB_TPU_ADDR"):  # legacy: Colab's TPU Node runtime, retired in 2024
        found.append((f"grpc://{environ['COLAB_TPU_ADDR']}",
                      "COLAB_TPU_ADDR is set (legacy Colab TPU Node runtime)"))
    return found


def _evidence(here: LocalTPU) -> str:
    parts = []
    if here.chips:
        parts.append(f"{here.chips} TPU chip(s) on the PCI bus")
    if here.device_nodes:
        parts.append(f"{len(here.device_nodes)} TPU device node(s)")
    if here.variables:
        parts.append(", ".join(here.variables) + " set")
    return "; ".join(parts)


def check_local_fits(environ: Mapping[str, str] | None = None, root: str = "/",
                     hosts: int | None = None) -> None:
    """Refuses tpu='local' on a slice with more hosts than this one (see module docstring)."""
    environ = os.environ if environ is None else environ
    hosts = slice_hosts(environ, root) if hosts is None else hosts
    if hosts > 1:
        kind = environ.get("TPU_ACCELERATOR_TYPE", "this TPU slice")
        raise TPUSliceError(
            f"{kind} spans {hosts} hosts, but tpu='local' sees only this host's chips: each "
            "host would train its own unsynchronised copy. Pass the slice's name "
            "(create_strategy('tpu', tpu='NAME') or set TPU_NAME; it needs the tpu extra: "
            f"`{INSTALL_TPU}` in the clone) and keep input data on GCS (gs://...), "
            "readable by every host.")


def connect_tpu(tpu: str | None = None, environ: Mapping[str, str] | None = None,
                root: str = "/"):
    """Connects to and initialises the first TPU that answers; returns its resolver.

    Raises:
      TPUSliceError: tpu='local' on a multi-host slice (before or after initialising).
      TPUNotFoundError: no candidate answered; lists each one tried and why it failed.
    """
    environ = os.environ if environ is None else environ
    tried = []
    for name, why in tpu_candidates(tpu, environ, root):
        if name == "local":
            check_local_fits(environ, root)
        try:
            resolver = _initialize(name)
        except Exception as e:  # pylint: disable=broad-except
            tried.append(f"TPUClusterResolver(tpu={name!r}) because {why}: {_first_line(e)}")
            continue
        _check_slice(resolver, name)
        return resolver
    raise TPUNotFoundError(
        "No TPU found. Tried:\n  - " + "\n  - ".join(tried or _NOTHING_FOUND) + "\n"
        "On Colab choose Runtime > Change runtime type > TPU and install the TPU build from "
        f"the clone (`{INSTALL_TPU}`, see docs/tpu.md); on a Cloud TPU VM run on the VM "
        "itself; for a named TPU or a pod slice pass tpu='NAME' (or set TPU_NAME). To run "
        "without a TPU use create_strategy('auto').")


_NOTHING_FOUND = [
    "TPU_NAME (named Cloud TPU or pod slice): not set",
    "tpu='local' (TPU VM): no Google TPU chip (PCI 0x1ae0) on the PCI bus, no /dev/accelN "
    "node and no TPU_* variables",
]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _initialize(name: str):
    """TensorFlow's own steps: resolver, connect (remote TPUs), initialise, devices seen."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
    if name != "local":
        tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    if not tf.config.list_logical_devices("TPU"):
        raise RuntimeError("initialised, but no TPU devices are visible (is this the "
                           f"tensorflow-tpu build? `{INSTALL_TPU}` in the clone)")
    return resolver


def _check_slice(resolver, name: str) -> None:
    """After initialising: how many hosts the slice has; `local` must be the whole of it."""
    metadata = resolver.get_tpu_system_metadata()
    hosts = int(metadata.num_hosts)
    if name == "local" and hosts > 1:
        check_local_fits(hosts=hosts)
    _connected["hosts"] = hosts
    logging.info("tfpar: TPU %r initialised: %d host(s), %d core(s).", name, hosts,
                 int(metadata.num_cores))
