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
        "keras>=3.5",
        "absl-py",
        "ml-collections",
        "tensorflow-datasets",
        "importlib_resources",  # TFDS's download path (etils.epath) imports it; not declared by TFDS
        "numpy",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "nbclient", "nbformat", "ipykernel"],  # notebooks run in the tests
    },
    entry_points={
        "console_scripts": [
            "tfpar-train=tfpar.train:run",
            "tfpar-launch=tfpar.launch:run",
        ],
    },
)
