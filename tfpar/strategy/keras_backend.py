"""Keras must run on its TensorFlow backend: which one it runs on, read without importing it.

tfpar trains with tf.distribute. With `KERAS_BACKEND=jax` (set on some TPU images) or a
keras.json naming another backend, everything fails in confusing ways, or `import keras`
itself fails ("No module named 'jax'"). `create_strategy` and `tfpar-train` call
`check_keras_backend` first: one error naming the backend, where it was set and the fix.

Example:
    >>> keras_backend({"KERAS_BACKEND": "jax"}, modules={})
    ('jax', 'KERAS_BACKEND=jax')
    >>> check_keras_backend()          # raises KerasBackendError unless TensorFlow
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any, Mapping

from tfpar.errors import KerasBackendError


def keras_backend(environ: Mapping[str, str] | None = None,
                  modules: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """The backend Keras runs on (or will, once imported) and where that was set.

    Read as Keras reads it (keras/src/backend/config.py: "backend" in keras.json under
    KERAS_HOME or ~/.keras, then a non-empty KERAS_BACKEND), without importing Keras,
    whose import fails outright when that backend is not installed.

    Example:
        >>> keras_backend({"KERAS_BACKEND": "jax"}, modules={})
        ('jax', 'KERAS_BACKEND=jax')
    """
    modules = sys.modules if modules is None else modules
    environ = os.environ if environ is None else environ
    named = f"KERAS_BACKEND={environ['KERAS_BACKEND']}" if environ.get("KERAS_BACKEND") else ""
    keras = modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return keras.backend.backend(), "Keras is imported with it" + (f", {named}" if named else "")
    if named:
        return environ["KERAS_BACKEND"], named
    path = os.path.join(_keras_dir(environ), "keras.json")
    try:
        with open(path, encoding="utf-8") as f:
            name = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        name = None
    if name:
        return name, f'"backend": "{name}" in {path}'
    return "tensorflow", "Keras's default"


def _keras_dir(environ: Mapping[str, str]) -> str:
    if environ.get("KERAS_HOME"):
        return environ["KERAS_HOME"]
    home = os.path.expanduser("~")
    return os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".keras")


def check_keras_backend(environ: Mapping[str, str] | None = None,
                        modules: Mapping[str, Any] | None = None) -> None:
    """Refuses any Keras backend but TensorFlow, by name, with where it was set and the fix.

    Raises:
      KerasBackendError: e.g. KERAS_BACKEND=jax (set on some TPU images).
    """
    name, source = keras_backend(environ, modules)
    if name != "tensorflow":
        raise KerasBackendError(f"tfpar trains with tf.distribute and needs Keras's TensorFlow "
                                f"backend, but Keras is set to {name!r} ({source}). "
                                f"{_backend_fix(name, source)}")


_IN_A_NOTEBOOK = '`os.environ["KERAS_BACKEND"] = "tensorflow"` in a notebook\'s first cell'


def _backend_fix(name: str, source: str) -> str:
    """What to change, where `keras_backend` found the backend."""
    where = "set KERAS_BACKEND=tensorflow"
    if "KERAS_BACKEND=" in source:
        where = "unset KERAS_BACKEND or set it to tensorflow"
    elif '"backend": ' in source:  # '"backend": "jax" in PATH'
        where = (f'set "backend": "tensorflow" in {source.rsplit(" in ", 1)[1]} '
                 "(or KERAS_BACKEND=tensorflow)")
    fix = (f"before anything imports keras, {where}: `export KERAS_BACKEND=tensorflow`, or "
           f"{_IN_A_NOTEBOOK}.")
    if source.startswith("Keras is imported"):
        return (f"Its backend cannot change in this process: {fix[:-1]}, then restart Python "
                "(a notebook: its runtime).")
    if name in ("jax", "torch") and importlib.util.find_spec(name) is None:
        fix += (f" As it is set, `import keras` itself fails: {name} is not installed "
                f"(\"No module named '{name}'\").")
    return fix[0].upper() + fix[1:]
