"""tfpar: train Keras 3 transformer models in parallel on TensorFlow."""

from setuptools import find_packages, setup

setup(
    name="tfpar",
    version="0.1.0",
    description="Train Keras 3 transformers in parallel on TensorFlow: one name picks the strategy.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    install_requires=[
        "tensorflow>=2.16,<2.22",
        "keras>=3.5,<3.16",  # the releases tfpar.strategy.keras_fixes was tested on
        "absl-py",
        "ml-collections",
        "tensorflow-datasets",
        "importlib_resources",  # TFDS's download path (etils.epath) imports it; not declared by TFDS
        "numpy",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        # pytest < 9.2: pytest-xdist 3.8's --dist loadgroup renames item._nodeid, which pytest
        # 9.2 no longer reads, so xdist_group marks were ignored (the convergence runs twice)
        "test": ["pytest>=7,<9.2", "pytest-timeout", "pytest-xdist", "nbclient", "nbformat", "ipykernel", "allpairspy>=2.5",
                 "keras-hub>=0.21,<0.33",  # notebooks run in the tests; allpairspy: test_matrix's cases; keras-hub: models not tfpar's (ZeRO, tensor parallelism)
                 "tensorboard-plugin-profile>=2.19"],  # the profile tests load traces with its loader
        # TensorBoard's Profile tab (trace viewer, input pipeline, memory) for the traces of
        # --config.train.profile_steps; it installs xprof, the loader tfpar's tests use too
        "profile": ["tensorboard-plugin-profile>=2.19"],
        # TPU VMs (Colab, Kaggle, Cloud TPU): TensorFlow's TPU build is its own distribution,
        # 2.20 the newest. tfpar is not on PyPI: from the clone, `pip install -e ".[tpu]" -f
        # https://storage.googleapis.com/libtpu-tf-releases/index.html` (Colab's -f: Google's
        # libtpu builds for TensorFlow; an extra cannot carry it, and libtpu is left to
        # tensorflow-tpu's own `libtpu~=0.0.14`, unverified on a TPU). `tensorflow` is pinned
        # to the same version so the requirement above does not pull 2.21 beside it; install
        # tensorflow-tpu last (docs/tpu.md) so its files win. google-api-python-client +
        # oauth2client: what TPUClusterResolver(tpu=NAME) needs to resolve a named TPU / pod
        # slice (cloud-tpu-client 0.10 would pin google-api-python-client==1.8.0 from 2020).
        "tpu": [
            'tensorflow==2.20.*; sys_platform == "linux"',
            'tensorflow-tpu==2.20.*; sys_platform == "linux"',
            "google-api-python-client",
            "oauth2client",
        ],
    },
    entry_points={
        "console_scripts": [
            "tfpar-train=tfpar.train:run",
            "tfpar-launch=tfpar.launch:run",
            "tfpar-check=tfpar.check:run",
        ],
    },
)
