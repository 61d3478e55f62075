"""TFDS adapter: `tfds:NAME[:CONFIG]` loads any TensorFlow Datasets dataset.

Per-worker sharding goes through `tfds.ReadConfig(input_context=...)` (FILE sharding by
TFDS itself) when the split has at least as many files as input pipelines; otherwise
examples are DATA-sharded. Images become float32 in [0, 1]; text becomes bytes + 2.

Example:
    >>> splits = tfds_splits("tfds:cifar10", data_dir="~/tensorflow_datasets")
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import re
import socket
import sys
import urllib.request

import tensorflow as tf

from tfpar.data.source import Shard, Source, Splits, shard_examples
from tfpar.errors import DataError


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'tfds:NAME[:CONFIG]' -> (NAME, CONFIG or None)."""
    parts = spec.split(":")
    if parts[0] != "tfds" or len(parts) not in (2, 3) or not parts[1]:
        raise DataError(f"data.name={spec!r} is not 'tfds:NAME' or 'tfds:NAME:CONFIG'.")
    return parts[1], (parts[2] if len(parts) == 3 else None)


def _image_example(image_key: str, label_key: str):
    def convert(example):
        return tf.cast(example[image_key], tf.float32) / 255.0, tf.cast(example[label_key], tf.int32)
    return convert


def _text_example(text_key: str, label_key: str, max_len: int):
    def convert(example):
        ids = tf.cast(tf.io.decode_raw(example[text_key], tf.uint8), tf.int32)[: max_len - 1] + 2
        ids = tf.concat([[1], ids], 0)
        ids = tf.pad(ids, [[0, max_len - tf.shape(ids)[0]]])
        ids.set_shape([max_len])
        return ids, tf.cast(example[label_key], tf.int32)
    return convert


def check_data_dir_for_slice(data_dir: str | None, hosts: int | None = None) -> None:
    """On a multi-host TPU slice every host reads its own input: the data must be on GCS.

    `hosts`: hosts of the slice; None asks tfpar.strategy.tpu (the TPU initialised, else
    this TPU VM's variables). Example: check_data_dir_for_slice("gs://bucket/tfds", 4).
    """
    from tfpar.strategy import tpu  # pylint: disable=import-outside-toplevel

    hosts = tpu.slice_hosts() if hosts is None else hosts
    where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets (TFDS's default)"
    if hosts <= 1 or str(where).startswith("gs://"):
        return
    raise DataError(
        f"This TPU slice has {hosts} hosts and each reads its own input, but data_dir is "
        f"{where}, a folder only this host sees. Copy the prepared dataset to GCS "
        "(gcloud storage cp -r DIR gs://BUCKET/tensorflow_datasets) and pass "
        "data_dir='gs://BUCKET/tensorflow_datasets'.")


def _split_facts(builder, split: str) -> tuple[int, int | None]:
    """(files, examples) of a prepared split; (1, None) where TFDS keeps no record of it
    (tfds.testing.mock_data, which the config tests use)."""
    if split not in builder.info.splits:
        return 1, None
    split_info = builder.info.splits[split]
    return len(split_info.filenames), split_info.num_examples


TFDS_MIRROR = "storage.googleapis.com"  # TFDS tries its prepared copies there first


def download_hosts(builder) -> list[str]:
    """The hosts a builder downloads from: TFDS's mirror and those its module names."""
    try:
        source = inspect.getsource(sys.modules[type(builder).__module__])
    except (OSError, TypeError, KeyError):
        source = ""
    named = re.findall(r"https?://([A-Za-z0-9.-]+)", source)
    return list(dict.fromkeys([TFDS_MIRROR, *named]))


def unreachable(hosts: list[str], timeout: float = 3.0) -> str | None:
    """None when any of `hosts` answers on port 443 within `timeout` seconds (all tried at
    once); otherwise why not, for the first one."""
    def connect(host: str) -> str | None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            return None
        except OSError as e:
            return f"{host}: {e.strerror or type(e).__name__}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(len(hosts), 1)) as pool:
        reasons = list(pool.map(connect, hosts))
    return None if not hosts or any(r is None for r in reasons) else reasons[0]


def _not_prepared(builder, spec: str, why: str) -> DataError:
    return DataError(
        f"{spec} is not prepared in {builder.data_dir_root} and could not be downloaded "
        f"({why}). On a machine with network, run `python -c \"import "
        f"tensorflow_datasets as tfds; tfds.builder('{builder.name}').download_and_prepare()\"`, "
        "copy its ~/tensorflow_datasets folder here, and pass --config.data.data_dir=THAT_FOLDER.")


def _prepare(builder, spec: str, data_dir: str | None) -> None:
    """Downloads and prepares the dataset once; without network, says how to bring it here
    at once (TFDS would retry its downloads for minutes first)."""
    if builder.is_prepared():
        return
    # Only where TFDS itself would download (not tfds.testing.mock_data's no-op), and not
    # behind a proxy, where a direct connection proves nothing
    downloads = type(builder).download_and_prepare.__module__.startswith("tensorflow_datasets.core")
    why = unreachable(download_hosts(builder)) if downloads and not urllib.request.getproxies() else None
    if why is not None:
        raise _not_prepared(builder, spec, f"no network: {why}")
    try:
        builder.download_and_prepare()
    except Exception as e:  # pylint: disable=broad-except  (network, disk, missing extras)
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise _not_prepared(builder, spec, f"{type(e).__name__}: {reason}") from None


def tfds_splits(spec: str, data_dir: str | None = None, max_len: int = 128,
                train_split: str = "train", validation_split: str = "test", seed: int = 0) -> Splits:
    """Train/validation sources of a TFDS dataset; images or text with a label."""
    import tensorflow_datasets as tfds

    name, config = parse_spec(spec)
    check_data_dir_for_slice(data_dir)
    try:
        builder = tfds.builder(name, config=config, data_dir=data_dir)
    except Exception as e:  # pylint: disable=broad-except
        raise DataError(f"TFDS has no dataset {spec!r} ({str(e).splitlines()[0]}). "
                         "Check the name with tfds.list_builders().") from None
    _prepare(builder, spec, data_dir)
    features = builder.info.features
    label_key = next(k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel))
    image_keys = [k for k, f in features.items() if isinstance(f, tfds.features.Image)]
    if image_keys:
        convert = _image_example(image_keys[0], label_key)
        shape = features[image_keys[0]].shape
        info = {"kind": "image", "image_size": shape[0], "channels": shape[2]}
    else:
        text_key = next(k for k, f in features.items() if isinstance(f, tfds.features.Text))
        convert = _text_example(text_key, label_key, max_len)
        info = {"kind": "classify", "vocab_size": 258, "max_len": max_len}
    info["num_classes"] = features[label_key].num_classes

    def source(split: str, name_suffix: str) -> Source:
        num_files, num_examples = _split_facts(builder, split)

        def build(shard: Shard, training: bool) -> tf.data.Dataset:
            read_config = tfds.ReadConfig(shuffle_seed=seed)
            if shard.by_file and shard.num > 1:
                read_config.input_context = tf.distribute.InputContext(
                    num_input_pipelines=shard.num, input_pipeline_id=shard.index)
            dataset = builder.as_dataset(split=split, read_config=read_config, shuffle_files=training)
            dataset = shard_examples(dataset, shard).map(convert, num_parallel_calls=tf.data.AUTOTUNE)
            if training:
                dataset = dataset.shuffle(10_000, seed=seed).repeat()
            return dataset

        return Source(f"{spec}/{name_suffix}", build, num_files=num_files,
                      num_examples=num_examples)

    return Splits(train=source(train_split, "train"), validation=source(validation_split, "validation"),
                  info=info)
